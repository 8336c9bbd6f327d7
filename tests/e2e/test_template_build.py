"""E2B's template builder (the unmodified SDK's `Template`) against a live server.

One server; the VMs: the build sandbox of the first build, one sandbox created from the
built template, the build sandbox of a failing build that reuses the first build's cached
prefix (a cold boot from the step cache). The identical rebuild boots nothing.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from api.conftest import REQUEST_TIMEOUT_S, qemu_processes, stop_and_check, use_sdk_env
from e2b import AsyncTemplate, BuildException, Sandbox, SandboxException, Template, wait_for_port
from e2b.template.types import TemplateBuildStatus

from agentenv.api.devserver import ServerProcess
from agentenv.template.datadir import prepare_home

pytestmark = pytest.mark.vm

BUILD_DEADLINE_S = 900.0
READY_TIMEOUT_S = 15
NAME = "webapp"
TIMINGS: dict[str, float] = {}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    home = prepare_home(tmp_path_factory.mktemp("build-home"))
    # No warm pool: fewer VMs, and a crash while a warm entry is being prepared is another
    # mechanism's recovery to test.
    env = {
        "AGENTENV_BUILD_READY_TIMEOUT_S": str(READY_TIMEOUT_S),
        "AGENTENV_WARM_LOW": "0",
        "AGENTENV_WARM_HIGH": "0",
    }
    srv = ServerProcess(home, env=env, ready_timeout_s=180).start()
    restore_env = use_sdk_env(srv)
    try:
        yield srv
    finally:
        restore_env()
        print(f"template build timings: {TIMINGS}")
        stop_and_check(srv)


@pytest.fixture(scope="module")
def context(tmp_path_factory: pytest.TempPathFactory) -> Path:
    ctx = tmp_path_factory.mktemp("ctx")
    (ctx / "hello.txt").write_text("copied from the context\n")
    return ctx


def api(server: ServerProcess) -> httpx.Client:
    return httpx.Client(
        base_url=server.url, headers={"X-API-Key": server.api_key}, timeout=REQUEST_TIMEOUT_S
    )


def webapp(context: Path) -> Any:
    return (
        Template(file_context_path=context)
        .from_template("base")
        .copy("hello.txt", "/home/user/")
        .run_cmd("echo hi > /home/user/x")
        .set_envs({"GREETING": "hello"})
        .run_cmd('echo "$GREETING from the build"')
        .set_start_cmd("python3 -m http.server 8000", wait_for_port(8000))
    )


def wait_done(info: Any) -> Any:
    """Polls the build status (bounded) until ready or error; returns the last status."""
    deadline = time.monotonic() + BUILD_DEADLINE_S
    while time.monotonic() < deadline:
        status = Template.get_build_status(info)
        if status.status in (TemplateBuildStatus.READY, TemplateBuildStatus.ERROR):
            return status
        time.sleep(1.0)
    raise AssertionError(f"build {info.build_id} not finished after {BUILD_DEADLINE_S}s")


def test_unknown_fields_are_refused(server: ServerProcess) -> None:
    with api(server) as c:
        r = c.post("/v3/templates", json={"name": "x", "bogus": 1})
        assert r.status_code == 400 and "bogus" in r.json()["message"]
        r = c.post("/v3/templates", json={"name": "x", "minFreeDiskMb": 100})
        assert r.status_code == 400 and "minFreeDiskMb" in r.json()["message"]
        r = c.post("/v3/templates", json={"name": "refused"})
        assert r.status_code == 202, r.text
        tid, bid = r.json()["templateID"], r.json()["buildID"]
        for body, named in (
            ({"fromTemplate": "base", "cache": True}, "cache"),
            ({"fromTemplate": "base", "steps": [{"type": "RUN", "args": ["x"], "y": 1}]}, "y"),
            (
                {
                    "fromImage": "x/y:1",
                    "fromImageRegistry": {
                        "type": "gcp",
                        "serviceAccountJson": "{}",
                    },
                },
                "gcp",
            ),
            ({"fromTemplate": "no-such-template"}, "no-such-template"),
        ):
            r = c.post(f"/v2/templates/{tid}/builds/{bid}", json=body)
            assert r.status_code == 400, r.text
            assert named in r.json()["message"]
            assert set(r.json()) == {"code", "message"}
        status = c.get(f"/templates/{tid}/builds/{bid}/status").json()
        assert status["status"] == "waiting"


def test_build_then_create(server: ServerProcess, context: Path) -> None:
    logs: list[str] = []
    t0 = time.monotonic()
    info = Template.build(
        webapp(context),
        NAME,
        cpu_count=1,
        memory_mb=512,
        on_build_logs=lambda e: logs.append(e.message),
    )
    TIMINGS["build_s"] = round(time.monotonic() - t0, 2)
    assert info.template_id == NAME
    assert any("hello from the build" in line for line in logs), logs[-30:]
    status = Template.get_build_status(info, logs_offset=0)
    assert status.status == TemplateBuildStatus.READY
    assert any("hello from the build" in e.message for e in status.log_entries)
    assert Template.exists(NAME) and Template.alias_exists(NAME)
    assert not Template.exists("never-built")

    t0 = time.monotonic()
    sbx = Sandbox.create(NAME, timeout=300)
    TIMINGS["create_from_built_s"] = round(time.monotonic() - t0, 2)
    try:
        # The server the build started answers at once: the create was a restore.
        with httpx.Client(timeout=30.0) as c:
            r = c.get(f"{server.url}/proxy/{sbx.sandbox_id}/8000/")
        assert r.status_code == 200, r.text[:300]
        assert sbx.files.read("/home/user/x") == "hi\n"
        assert sbx.files.read("/home/user/hello.txt") == "copied from the context\n"
        who = sbx.commands.run("whoami && pwd")
        assert who.stdout.split() == ["user", "/home/user"]
    finally:
        sbx.kill()

    logs2: list[str] = []
    t0 = time.monotonic()
    Template.build(
        webapp(context),
        NAME,
        on_build_logs=lambda e: logs2.append(e.message),
        cpu_count=1,
        memory_mb=512,
    )
    TIMINGS["cached_rebuild_s"] = round(time.monotonic() - t0, 2)
    assert sum("CACHED" in line for line in logs2) == 4, logs2
    assert TIMINGS["cached_rebuild_s"] < TIMINGS["build_s"]

    # The async SDK speaks the same wire: an identical build is a cache hit (no VM).
    async def async_build() -> tuple[bool, Any]:
        info = await AsyncTemplate.build(webapp(context), NAME, cpu_count=1, memory_mb=512)
        status = await AsyncTemplate.get_build_status(info, logs_offset=0)
        return await AsyncTemplate.exists(NAME), status

    exists, status = asyncio.run(async_build())
    assert exists and status.status == TemplateBuildStatus.READY
    assert any(e.message.startswith("CACHED") for e in status.log_entries)


def test_failing_step_reuses_cached_prefix(server: ServerProcess, context: Path) -> None:
    failing = (
        Template(file_context_path=context)
        .from_template("base")
        .copy("hello.txt", "/home/user/")
        .run_cmd("echo hi > /home/user/x")
        .run_cmd("echo about to fail; exit 3")
    )
    t0 = time.monotonic()
    info = Template.build_in_background(failing, "failing", cpu_count=1, memory_mb=512)
    status = wait_done(info)
    TIMINGS["failing_build_s"] = round(time.monotonic() - t0, 2)
    assert status.status == TemplateBuildStatus.ERROR
    assert status.reason is not None and status.reason.step == "3", status.reason
    assert "exit code 3" in status.reason.message
    assert any("about to fail" in e.message for e in status.reason.log_entries)
    messages = [e.message for e in Template.get_build_status(info, logs_offset=0).log_entries]
    assert sum(m.startswith("CACHED") for m in messages) == 2, messages
    with pytest.raises(BuildException, match="exit code 3"):
        Template.build(failing, "failing", cpu_count=1, memory_mb=512)
    with api(server) as c:
        live = c.get("/v2/sandboxes").json()
        assert live == [], live
        # Build sandboxes are not listed: the gauge says none is left.
        assert "agentenv_build_sandboxes 0.0" in c.get("/metrics").text


def test_ready_cmd_that_never_succeeds(server: ServerProcess) -> None:
    never = Template().from_template("base").set_start_cmd("sleep 600", "test -f /never")
    info = Template.build_in_background(never, "never-ready", cpu_count=1, memory_mb=512)
    status = wait_done(info)
    assert status.status == TemplateBuildStatus.ERROR
    assert status.reason is not None and status.reason.step == "finalize"
    assert "readyCmd" in status.reason.message and "test -f /never" in status.reason.message
    # As E2B: the name exists from its build request on, but no ready build carries a tag.
    assert Template.exists("never-ready")
    assert not Template.exists("never-ready:default")
    with pytest.raises(SandboxException, match=r"404.*tag 'default'"):
        Sandbox.create("never-ready")


def wait_for_line(info: Any, line: str) -> None:
    deadline = time.monotonic() + BUILD_DEADLINE_S
    while time.monotonic() < deadline:
        status = Template.get_build_status(info, logs_offset=0)
        if any(e.message == line for e in status.log_entries):
            return
        time.sleep(0.5)
    raise AssertionError(f"no log line {line!r}")


def test_shutdown_cancels_a_build_and_its_sandbox(server: ServerProcess) -> None:
    slow = Template().from_template("base").run_cmd("echo napping; sleep 300")
    info = Template.build_in_background(slow, "shutdown", cpu_count=1, memory_mb=512)
    wait_for_line(info, "napping")
    stop_and_check(server)  # no QEMU left, clean shutdown
    server.start()
    status = Template.get_build_status(info, logs_offset=0)
    assert status.status == TemplateBuildStatus.ERROR
    assert status.reason is not None and "server shutdown" in status.reason.message


def test_restart_fails_an_interrupted_build(server: ServerProcess) -> None:
    slow = Template().from_template("base").run_cmd("echo sleeping; sleep 300")
    info = Template.build_in_background(slow, "interrupted", cpu_count=1, memory_mb=512)
    deadline = time.monotonic() + BUILD_DEADLINE_S
    while time.monotonic() < deadline:
        status = Template.get_build_status(info, logs_offset=0)
        if any(e.message == "sleeping" for e in status.log_entries):
            break
        time.sleep(0.5)
    else:
        raise AssertionError("the slow step never started")
    server.crash()
    server.start()
    status = Template.get_build_status(info, logs_offset=0)
    assert status.status == TemplateBuildStatus.ERROR
    assert status.reason is not None and "interrupted" in status.reason.message
    with api(server) as c:
        assert c.get("/v2/sandboxes").json() == []
        assert "agentenv_build_sandboxes 0.0" in c.get("/metrics").text
    assert not qemu_processes(server.home), "the build sandbox outlived the restart"
