"""E2B's template builder in the official JS SDK (npm `e2b`, pinned in
tests/e2e/js/package-lock.json) against a live server: the scenarios of
tests/e2e/js/template_build.mjs, each in its own node process.

One server for the module, no warm pool. The VMs: the build sandbox of `jsapp` and two
sandboxes created from it (the identical rebuild boots nothing), the build sandbox of a
background build, of a failing one, and of a busybox image build (pulled from Debian's
docker-registry on 127.0.0.1) plus one sandbox from it.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from api.conftest import REQUEST_TIMEOUT_S, stop_and_check
from jsrun import JsEnv, js_workdir, node
from oci.images import Pusher
from oci.registry import REGISTRY_BIN, Registry
from template.imagebuild import push_busybox

from agentenv.api.devserver import ServerProcess
from agentenv.template.datadir import prepare_home

pytestmark = pytest.mark.vm

SCRIPT = "template_build.mjs"


@dataclass
class Env:
    js: JsEnv
    context: Path
    registry: Registry


def make_context(ctx: Path) -> Path:
    app = ctx / "app"
    (app / "sub").mkdir(parents=True)
    (app / "hello.txt").write_text("copied by the js sdk\n")
    (app / "sub" / "nested.txt").write_text("nested\n")
    (app / ".hidden").write_text("dot\n")
    (ctx / "run.sh").write_text('#!/bin/sh\necho "run.sh ran in $(pwd) as $(whoami)"\n')
    return ctx


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    if not Path(REGISTRY_BIN).exists():
        pytest.fail("docker-registry is needed: scripts/test installs it")
    root = tmp_path_factory.mktemp("js-build")
    work = js_workdir(tmp_path_factory.mktemp("js-build-work"))
    context = make_context(root / "ctx")
    reg = Registry.start(root / "registry", root / "storage")
    srv: ServerProcess | None = None
    try:
        pusher = Pusher(reg.url)
        try:
            push_busybox(pusher)
        finally:
            pusher.close()
        env = {
            "AGENTENV_BUILD_READY_TIMEOUT_S": "30",
            "AGENTENV_WARM_LOW": "0",
            "AGENTENV_WARM_HIGH": "0",
        }
        srv = ServerProcess(
            prepare_home(root / "home"), domain="sbx.test", env=env, ready_timeout_s=180
        )
        srv.start()
        yield Env(JsEnv(srv, work, uuid.uuid4().hex[:12]), context, reg)
    finally:
        if srv is not None:
            log = srv.log_tail(4000)
            stop_and_check(srv)
            assert "Traceback" not in log, log[-4000:]
        reg.stop()


def test_build_copy_env_workdir_start_then_create(env: Env) -> None:
    node(env.js, SCRIPT, "build", str(env.context))


def test_build_in_background_status_and_exists(env: Env) -> None:
    node(env.js, SCRIPT, "background")


def test_failing_run_step_raises_build_error(env: Env) -> None:
    node(env.js, SCRIPT, "failing")
    with httpx.Client(
        base_url=env.js.server.url,
        headers={"X-API-Key": env.js.server.api_key},
        timeout=REQUEST_TIMEOUT_S,
        trust_env=False,
    ) as c:
        # The failed build's sandbox is gone (build sandboxes are not listed: the gauge).
        assert "agentenv_build_sandboxes 0.0" in c.get("/metrics").text


def test_from_image(env: Env) -> None:
    node(env.js, SCRIPT, "image", str(env.context), env.registry.host)
