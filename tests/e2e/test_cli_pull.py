"""`aenv pull` and `aenv build` from an image against a real server: a busybox image on a
loopback docker-registry that wants a password, pulled into a template with a start command,
the per-layer progress bars and log lines, a sandbox from the result; and the errors (unknown
image, wrong or missing credentials) as one line and exit 1."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from api.conftest import env_unchanged, stop_and_check, use_sdk_env
from e2b import Sandbox
from oci.images import Pusher
from oci.registry import REGISTRY_BIN, Registry
from template.imagebuild import push_busybox

from agentenv.api.devserver import ServerProcess
from agentenv.template.datadir import prepare_home

pytestmark = pytest.mark.vm

AENV = [sys.executable, "-m", "agentenv.cli"]
USER, PASSWORD = "puller", "pull-secret"


@dataclass
class Env:
    server: ServerProcess
    open: Registry  # no auth: pushes go here
    locked: Registry  # the same storage behind htpasswd
    cli_env: dict[str, str]
    root: Path


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    if not Path(REGISTRY_BIN).exists():
        pytest.fail("docker-registry is needed: scripts/test installs it")
    root = tmp_path_factory.mktemp("cli-pull")
    storage = root / "storage"
    started: list[Registry] = []
    srv: ServerProcess | None = None
    restore_env: Callable[[], None] = env_unchanged
    try:
        open_reg = Registry.start(root / "open", storage)
        started.append(open_reg)
        locked = Registry.start_basic(root / "locked", storage, USER, PASSWORD)
        started.append(locked)
        pusher = Pusher(open_reg.url)
        try:
            push_busybox(pusher)
        finally:
            pusher.close()
        home = prepare_home(root / "home")
        srv = ServerProcess(
            home, env={"AGENTENV_WARM_LOW": "0", "AGENTENV_WARM_HIGH": "0"}, ready_timeout_s=180
        ).start()
        cli_env = {
            k: v for k, v in os.environ.items() if not k.startswith(("E2B_", "AGENTENV_", "AENV_"))
        }
        cli_env.update(
            AGENTENV_URL=srv.url, AGENTENV_API_KEY=srv.api_key, XDG_CONFIG_HOME=str(root / "cfg")
        )
        restore_env = use_sdk_env(srv)
        yield Env(srv, open_reg, locked, cli_env, root)
    finally:
        restore_env()
        if srv is not None:
            stop_and_check(srv)
        for reg in started:
            reg.stop()


def aenv(env: Env, *args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*AENV, *args], env=env.cli_env, capture_output=True, text=True, timeout=timeout
    )


def test_pull_with_credentials_progress_and_start_command(env: Env) -> None:
    got = aenv(
        env,
        "pull", f"{env.locked.host}/busybox:1",
        "--username", USER, "--password", PASSWORD,
        "--start-cmd", "httpd -f -p 8080 -h /app",
        "--ready-cmd", "wget -q -O /dev/null http://127.0.0.1:8080/data.txt",
    )  # fmt: skip
    print(f"aenv pull stdout:\n{got.stdout}\naenv pull stderr:\n{got.stderr}")
    assert got.returncode == 0, got.stderr[-3000:]
    # The log (stdout): one line per layer and phase as it completes, then the build.
    for line in ("layer 1/2", "layer 2/2", "downloaded", "block layer written", "readyCmd"):
        assert line in got.stdout, got.stdout[-3000:]
    # The bars (stderr): drawn from the progress route, every layer and phase complete.
    for bar in ("layer 1/2 download", "layer 2/2 download", "layer 1/2 convert",
                "layer 2/2 convert"):  # fmt: skip
        assert bar in got.stderr, got.stderr[-3000:]
    assert "template busybox-1 ready" in got.stderr
    sbx = Sandbox.create("busybox-1", timeout=120)
    try:
        with httpx.Client(timeout=30.0) as c:
            r = c.get(f"{env.server.url}/proxy/{sbx.sandbox_id}/8080/data.txt")
        assert r.status_code == 200 and r.text == "from layer two\n"
    finally:
        sbx.kill()


def test_build_from_an_image_shows_the_same_bars(env: Env) -> None:
    ctx = env.root / "ctx"
    ctx.mkdir(exist_ok=True)
    (ctx / "Dockerfile").write_text(f"FROM {env.open.host}/busybox:1\nRUN echo from-build\n")
    got = aenv(env, "build", "--name", "clibb", str(ctx))
    assert got.returncode == 0, got.stderr[-3000:]
    assert "from-build" in got.stdout
    # Same image as the pull above: its layers are cached, and shown so.
    assert "layer 1/2 download (cached)" in got.stderr, got.stderr[-3000:]
    assert "layer 2/2 convert  (cached)" in got.stderr, got.stderr[-3000:]


def _one_error_line(got: subprocess.CompletedProcess[str]) -> str:
    assert got.returncode == 1, (got.stdout[-2000:], got.stderr[-2000:])
    lines = got.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), got.stderr
    return lines[0]


def test_errors_are_one_line(env: Env) -> None:
    unknown = _one_error_line(aenv(env, "pull", f"{env.open.host}/nope:1", "--name", "nope"))
    assert "manifest unknown" in unknown
    wrong = _one_error_line(
        aenv(env, "pull", f"{env.locked.host}/busybox:1", "-u", USER, "-p", "wrong")
    )
    assert "refused access as 'puller'" in wrong
    anonymous = _one_error_line(aenv(env, "pull", f"{env.locked.host}/busybox:1"))
    assert "wants a username and password" in anonymous
