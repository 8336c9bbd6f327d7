"""`Template().from_image(...)` and `Template().from_dockerfile(...)` through the unmodified
SDK: a static busybox image (no libc) pulled from a registry on loopback, steps run in it,
its start command captured running, sandboxes created from the result."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from api.conftest import env_unchanged, stop_and_check, use_sdk_env
from e2b import Sandbox, Template
from oci.images import Pusher
from oci.registry import REGISTRY_BIN, Registry
from template.imagebuild import push_busybox

from agentenv.api.devserver import ServerProcess
from agentenv.template.datadir import prepare_home

pytestmark = pytest.mark.vm

TIMINGS: dict[str, float] = {}


@dataclass
class Env:
    server: ServerProcess
    registry: Registry
    context: Path


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    if not Path(REGISTRY_BIN).exists():
        pytest.fail("docker-registry is needed: scripts/test installs it")
    root = tmp_path_factory.mktemp("build-image")
    reg = Registry.start(root / "registry", root / "storage")
    srv: ServerProcess | None = None
    restore_env: Callable[[], None] = env_unchanged
    try:
        pusher = Pusher(reg.url)
        try:
            push_busybox(pusher)
        finally:
            pusher.close()
        context = root / "ctx"
        context.mkdir()
        (context / "hello.txt").write_text("hello from the context\n")
        home = prepare_home(root / "home")
        srv = ServerProcess(
            home, env={"AGENTENV_WARM_LOW": "0", "AGENTENV_WARM_HIGH": "0"}, ready_timeout_s=180
        ).start()
        restore_env = use_sdk_env(srv)
        yield Env(srv, reg, context)
    finally:
        restore_env()
        print(f"image build timings: {TIMINGS}")
        if srv is not None:
            stop_and_check(srv)
        reg.stop()


def test_from_image_copy_run_start(env: Env) -> None:
    ref = f"{env.registry.host}/busybox:1"
    t = (
        Template(file_context_path=env.context)
        .from_image(ref)
        .copy("hello.txt", "/app/")
        .run_cmd("echo built > /app/built.txt", user="root")
        .set_start_cmd(
            "httpd -f -p 8080 -h /app", "wget -q -O /dev/null http://127.0.0.1:8080/hello.txt"
        )
    )
    logs: list[str] = []
    t0 = time.monotonic()
    Template.build(
        t, "busyapp", cpu_count=1, memory_mb=512, on_build_logs=lambda e: logs.append(e.message)
    )
    TIMINGS["image_build_s"] = round(time.monotonic() - t0, 2)
    assert any("pulled" in line for line in logs), logs
    t0 = time.monotonic()
    sbx = Sandbox.create("busyapp", timeout=300)
    TIMINGS["image_create_s"] = round(time.monotonic() - t0, 2)
    try:
        with httpx.Client(timeout=30.0) as c:
            r = c.get(f"{env.server.url}/proxy/{sbx.sandbox_id}/8080/hello.txt")
        assert r.status_code == 200 and r.text == "hello from the context\n"
        assert sbx.files.read("/app/built.txt") == "built\n"
        # The image's WorkingDir is the sandbox's, its env reaches commands.
        assert sbx.commands.run("pwd; echo $GREETING").stdout.split("\n")[:2] == [
            "/app",
            "hello world",
        ]
    finally:
        sbx.kill()


def test_from_dockerfile(env: Env) -> None:
    dockerfile = "\n".join(
        [
            f"FROM {env.registry.host}/busybox:1",
            "ENV MODE=docker",
            "WORKDIR /srv",
            "COPY hello.txt ./",
            'RUN echo "$MODE" > /srv/mode.txt',
        ]
    )
    t = Template(file_context_path=env.context).from_dockerfile(dockerfile)
    Template.build(t, "fromdocker", cpu_count=1, memory_mb=512)
    sbx = Sandbox.create("fromdocker", timeout=300)
    try:
        assert sbx.files.read("/srv/mode.txt") == "docker\n"
        assert sbx.files.read("/srv/hello.txt") == "hello from the context\n"
        # The parser ends with USER user (the Dockerfile set none) and keeps its WORKDIR:
        # the last ones are the sandbox's defaults.
        assert sbx.commands.run("id -un; pwd").stdout.split() == ["user", "/srv"]
    finally:
        sbx.kill()


def test_aenv_build_and_template_logs(env: Env) -> None:
    (env.context / "Dockerfile").write_text(
        f"FROM {env.registry.host}/busybox:1\nCOPY hello.txt /opt/\nRUN echo cli-step-output\n"
    )
    run_env = {**os.environ, **env.server.sdk_env()}
    aenv = [sys.executable, "-m", "agentenv.cli"]
    built = subprocess.run(
        [*aenv, "build", "--name", "clibuilt", str(env.context)],
        env=run_env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert built.returncode == 0, built.stderr[-2000:]
    assert "cli-step-output" in built.stdout, built.stdout[-2000:]
    logs = subprocess.run(
        [*aenv, "template", "logs", "clibuilt"],
        env=run_env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert logs.returncode == 0, logs.stderr
    assert "[4] cli-step-output" in logs.stdout, logs.stdout
    assert Template.exists("clibuilt")
    ls = subprocess.run(
        [*aenv, "template", "rm", "clibuilt"],
        env=run_env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert ls.returncode == 0, ls.stderr
    assert not Template.exists("clibuilt")
