"""The `docker` template (`template.docker`) on a real microVM: Docker Engine and Compose v2
inside a sandbox, with no internet.

One server, one sandbox (its create restores the template snapshot the server builds on first
use, dockerd already running). The test makes a docker-archive of Debian's static busybox in
Python, uploads it through the E2B SDK, `docker load`s it, runs a container, then a two-service
compose project whose client fetches a page from the other service by its name over the
project's network. Container networks are 100.88.0.0/16 and 100.89.0.0/16 inside the guest
(the template's daemon.json), so no traffic goes to a private range.
"""

from __future__ import annotations

import io
import json
import tarfile
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest
from api.conftest import REQUEST_TIMEOUT_S, stop_and_check, use_sdk_env
from e2b import CommandExitException, Sandbox
from oci.images import Layer, image_config, sha

from agentenv.api.devserver import ServerProcess
from agentenv.config import Settings
from agentenv.template.cache import ArtifactCache
from agentenv.template.datadir import prepare_home
from agentenv.template.docker import docker_inputs, ensure_docker

pytestmark = pytest.mark.vm

BUSYBOX = Path("/bin/busybox")
IMAGE = "agentenv-test/busybox:1"
PAGE = "served by the web service\n"
# The default shape. Measured: ~100 MB used with dockerd and containerd idle, ~120 MB after
# the compose project (page cache aside).
MEMORY_MB = 512
CMD_TIMEOUT_S = 240
# Measurements, printed at the end of the module (docs/docker.md quotes them).
TIMINGS: dict[str, object] = {}

# The client asks the web service by its name (compose's network, Docker's embedded DNS).
# nc, not wget: the wget of Debian's busybox-static 1.35 segfaults on every request. Bounded:
# 50 tries, 2 s each at most.
COMPOSE = f"""\
services:
  web:
    image: {IMAGE}
    command: ["httpd", "-f", "-p", "8080", "-h", "/www"]
    # httpd is the container's PID 1 and has no SIGTERM handler: the kernel ignores the
    # signal, so the stop that ends `up --abort-on-container-exit` would wait out Docker's
    # 10 s grace period before its SIGKILL.
    stop_grace_period: 1s
  client:
    image: {IMAGE}
    depends_on: [web]
    command:
      - sh
      - -c
      - |
        for i in $$(seq 1 50); do
          out=$$(printf 'GET / HTTP/1.0\\r\\n\\r\\n' | nc -w 2 web 8080)
          case "$$out" in *served*) echo "$$out"; exit 0;; esac
          sleep 0.2
        done
        exit 1
"""


def busybox_archive() -> bytes:
    """A `docker save` style archive (manifest.json, config, one layer) of a busybox image."""
    if not BUSYBOX.is_file():
        pytest.fail("busybox-static is needed (/bin/busybox; `aenv setup` installs it)")
    layer = (
        Layer()
        .dir("bin").dir("etc").dir("www").dir("tmp", 0o1777)
        .file("bin/busybox", BUSYBOX.read_bytes(), 0o755)
        .file("etc/passwd", b"root:x:0:0:root:/root:/bin/sh\n")
        .file("etc/group", b"root:x:0:\n")
        .file("www/index.html", PAGE.encode())
    )  # fmt: skip
    for applet in ("sh", "echo", "httpd", "nc", "seq", "sleep", "cat", "printf"):
        layer.symlink(f"bin/{applet}", "busybox")
    layer_tar = layer.tar()
    diff_id = sha(layer_tar)
    config = image_config([diff_id], Env=["PATH=/bin"], Cmd=["sh"])
    config_name = sha(config).removeprefix("sha256:") + ".json"
    layer_name = diff_id.removeprefix("sha256:") + "/layer.tar"
    manifest = [{"Config": config_name, "RepoTags": [IMAGE], "Layers": [layer_name]}]
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tf:
        for name, data in (
            (config_name, config),
            (layer_name, layer_tar),
            ("manifest.json", json.dumps(manifest).encode()),
        ):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mtime = 1_700_000_000
            tf.addfile(info, io.BytesIO(data))
    return out.getvalue()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    home = prepare_home(tmp_path_factory.mktemp("docker-home"))
    settings = replace(Settings.from_env(), home=home)
    t0 = time.monotonic()
    # Built on first use (debootstrap from the Debian mirror), else a cache hit.
    ensure_docker(settings, None)
    TIMINGS["template ensure s"] = round(time.monotonic() - t0, 1)
    built = ArtifactCache(settings.cache).lookup("rootfs-docker", docker_inputs())
    assert built is not None
    TIMINGS["template qcow2 MB"] = round((built / "docker.qcow2").stat().st_size / 2**20)
    TIMINGS["template build s (when built)"] = json.loads((built / "build.json").read_text())[
        "build_seconds"
    ]
    env = {"AGENTENV_WARM_LOW": "0", "AGENTENV_WARM_HIGH": "0"}
    srv = ServerProcess(home, env=env, ready_timeout_s=180).start()
    restore_env = use_sdk_env(srv)
    try:
        yield srv
    finally:
        restore_env()
        print(f"docker template timings: {TIMINGS}")
        stop_and_check(srv)


def sh(sbx: Any, cmd: str, user: str = "user") -> str:
    try:
        result = sbx.commands.run(cmd, user=user, timeout=CMD_TIMEOUT_S)
    except CommandExitException as exc:
        pytest.fail(f"{cmd!r} exited {exc.exit_code}: {exc.stdout}{exc.stderr}")
    return str(result.stdout)


def timed(name: str, sbx: Any, cmd: str, user: str = "user") -> str:
    t0 = time.monotonic()
    out = sh(sbx, cmd, user)
    TIMINGS[name] = round(time.monotonic() - t0, 2)
    return out


def test_docker_run_and_compose_without_internet(server: ServerProcess) -> None:
    with httpx.Client(
        base_url=server.url, headers={"X-API-Key": server.api_key}, timeout=REQUEST_TIMEOUT_S
    ) as api:
        t0 = time.monotonic()
        r = api.post(
            "/sandboxes",
            json={"templateID": "docker", "memoryMB": MEMORY_MB, "timeout": 900},
        )
        assert r.status_code == 201, r.text
        TIMINGS["first create s (builds the template snapshot)"] = round(time.monotonic() - t0, 1)
        sid = r.json()["sandboxID"]
        try:
            sbx = Sandbox.connect(sid)
            _exercise(sbx)
        finally:
            assert api.delete(f"/sandboxes/{sid}").status_code == 204

        # Later creates restore the snapshot: dockerd answers at once, nothing left of the
        # first sandbox's containers or images.
        t0 = time.monotonic()
        r = api.post("/sandboxes", json={"templateID": "docker", "memoryMB": MEMORY_MB})
        assert r.status_code == 201, r.text
        TIMINGS["next create s"] = round(time.monotonic() - t0, 1)
        sid = r.json()["sandboxID"]
        try:
            sbx = Sandbox.connect(sid)
            assert sh(sbx, "docker image ls -q").strip() == ""
            assert sh(sbx, "docker ps -q").strip() == ""
        finally:
            assert api.delete(f"/sandboxes/{sid}").status_code == 204


def _exercise(sbx: Any) -> None:
    # The kernel features and cgroup v2 that dockerd relies on, as it reports them.
    assert sh(sbx, "stat -fc %T /sys/fs/cgroup").strip() == "cgroup2fs"
    info = json.loads(sh(sbx, "docker info --format '{{json .}}'"))
    assert info["CgroupVersion"] == "2" and info["Driver"] == "overlay2", info
    assert sh(sbx, "docker compose version --short").strip().startswith("2.")
    subnet = "docker network inspect bridge --format '{{(index .IPAM.Config 0).Subnet}}'"
    assert sh(sbx, subnet).strip() == "100.88.0.0/24"  # daemon.json, not 172.17/16
    # dockerd came up in the template's boot, before envd: the snapshot holds it running.
    hook_log = sh(sbx, "cat /run/agentenv/start-docker.log")
    TIMINGS["kernel"] = sh(sbx, "uname -r").strip()
    ready = [ln for ln in hook_log.splitlines() if ln.startswith("dockerd ready in ")]
    assert ready, hook_log
    TIMINGS["dockerd start s (template boot)"] = int(ready[-1].split()[3]) / 1000

    sbx.files.write("/home/user/busybox.tar", busybox_archive())
    loaded = timed("docker load s", sbx, "docker load -i /home/user/busybox.tar")
    assert f"Loaded image: {IMAGE}" in loaded
    assert timed("docker run s", sbx, f"docker run --rm {IMAGE} echo hi") == "hi\n"

    sbx.files.write("/home/user/app/compose.yaml", COMPOSE)
    out = timed(
        "compose up s",
        sbx,
        "cd /home/user/app && docker compose up --abort-on-container-exit "
        "--exit-code-from client 2>&1",
    )
    assert PAGE.strip() in out, out
    timed("compose down s", sbx, "cd /home/user/app && docker compose down 2>&1")
    assert sh(sbx, "docker ps -aq").strip() == ""
    networks = sh(sbx, "docker network ls --format '{{.Name}}'").split()
    assert sorted(networks) == ["bridge", "host", "none"], networks
    assert sh(sbx, "docker image ls -q " + IMAGE).strip()
    TIMINGS["guest MB used after compose"] = int(sh(sbx, "free -m").split("\n")[1].split()[2])
