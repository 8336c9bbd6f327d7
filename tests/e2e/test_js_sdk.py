"""The official E2B JS SDK (npm `e2b`, pinned in tests/e2e/js/package-lock.json), run by node,
against `aenv serve` booting real microVMs.

Each test runs one scenario script (tests/e2e/js/*.mjs) in its own node process; the script
asserts and exits non-zero with a message when something is off. Most scenarios share one
sandbox (made by the `create` scenario; guests run under TCG, so few VMs and never more than
two at a time): `create`, streaming, a background child, stdin, PTY, files, watch, list by
metadata, connect, then pause/resume, snapshot, fork and its expiry; `timeout` makes two
short-lived ones of its own.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import httpx
import pytest
from jsrun import JsEnv, js_workdir, node

from agentenv.api.devserver import ServerProcess
from agentenv.template.datadir import prepare_home

pytestmark = pytest.mark.vm


@pytest.fixture(scope="module")
def js(tmp_path_factory: pytest.TempPathFactory) -> Iterator[JsEnv]:

    work = js_workdir(tmp_path_factory.mktemp("js-sdk"))
    home = tmp_path_factory.mktemp("js-home")
    prepare_home(home)
    srv = ServerProcess(home, domain="sbx.test", ready_timeout_s=180).start()
    try:
        yield JsEnv(srv, work, uuid.uuid4().hex[:12])
    finally:
        log = srv.log_tail(4000)
        srv.stop(timeout_s=120)
        assert "Traceback" not in log, log[-4000:]


@pytest.fixture(scope="module")
def sandbox_id(js: JsEnv) -> Iterator[str]:
    out = node(js, "sandbox.mjs", "create")
    ids = [line.split("=", 1)[1] for line in out.splitlines() if line.startswith("SANDBOX_ID=")]
    assert ids, out
    yield ids[0]
    # Whatever the scenarios left (an `expire` that did not run or failed): removed here.
    with httpx.Client(base_url=js.server.url, timeout=60, trust_env=False) as c:
        c.delete(f"/sandboxes/{ids[0]}", headers={"X-API-Key": js.server.api_key})


def test_create(sandbox_id: str) -> None:
    assert sandbox_id.startswith("i")


@pytest.mark.parametrize(
    "scenario",
    ["streaming", "background_child", "stdin", "pty", "files", "watch", "list_metadata", "connect"],
)
def test_sandbox_scenario(js: JsEnv, sandbox_id: str, scenario: str) -> None:
    node(js, "sandbox.mjs", scenario, sandbox_id)


def test_timeout(js: JsEnv) -> None:
    node(js, "lifecycle.mjs", "timeout")


# In this order: pause/resume and snapshot expect `background_child`'s server still running.
@pytest.mark.parametrize("scenario", ["pause_resume", "snapshot", "fork", "expire"])
def test_lifecycle_scenario(js: JsEnv, sandbox_id: str, scenario: str) -> None:
    node(js, "lifecycle.mjs", scenario, sandbox_id)
