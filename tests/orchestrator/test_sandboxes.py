"""The sandbox state machine with real envd processes (local runtime) behind it."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from agentenv.orchestrator.errors import (
    BadRequest,
    Conflict,
    CreateFailed,
    NotSupported,
    SandboxNotFound,
    TemplateNotFound,
)
from agentenv.orchestrator.local import LocalRuntime, StaticTemplates
from agentenv.orchestrator.runtime import Placement
from agentenv.orchestrator.sandboxes import CreateSpec, SandboxManager
from agentenv.orchestrator.store import SandboxRecord, SandboxState, Store


class BrokenInitRuntime(LocalRuntime):
    """A runtime whose sandboxes come up but whose envd then refuses `/init`.

    A real envd only refuses `/init` on bad input, which the API already rejects; this fault is
    injected by pointing the placement at a port where nothing listens.
    """

    async def create(self, template: str, cpu: int, memory_mb: int, disk_size_mb: int) -> Placement:
        placed = await super().create(template, cpu, memory_mb, disk_size_mb)
        self.last_pid = self._procs[placed.runtime_id].process.pid
        return Placement(placed.runtime_id, placed.address, f"http://{placed.address}:1")


def _manager(tmp_path: Path, runtime: LocalRuntime | None = None) -> SandboxManager:
    return SandboxManager(
        Store(tmp_path / "db.sqlite"),
        runtime or LocalRuntime(tmp_path / "run", default_user="root"),
        StaticTemplates(["base"]),
        envd_version="0.6.4",
    )


@pytest.fixture
async def mgr(tmp_path: Path) -> AsyncIterator[SandboxManager]:
    m = _manager(tmp_path)
    await m.start()
    try:
        yield m
    finally:
        await m.close()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _envd_pid(mgr: SandboxManager, rec: SandboxRecord) -> int:
    assert isinstance(mgr.runtime, LocalRuntime) and rec.runtime_id
    return mgr.runtime._procs[rec.runtime_id].process.pid


async def test_create_inits_envd_and_kill_releases_it(mgr: SandboxManager) -> None:
    rec = await mgr.create(CreateSpec("base", timeout=60, env_vars={"FOO": "bar"}))
    assert rec.state is SandboxState.RUNNING and rec.address and rec.envd_token
    pid = _envd_pid(mgr, rec)
    async with httpx.AsyncClient(trust_env=False) as http:
        # /init set the access token: envd now refuses requests without it.
        envs = await http.get(f"{rec.envd_url}/envs")
        assert envs.status_code == 401
        envs = await http.get(f"{rec.envd_url}/envs", headers={"X-Access-Token": rec.envd_token})
        assert envs.json()["FOO"] == "bar"
    await mgr.kill(rec.id)
    assert not _alive(pid)
    assert mgr.store.get(rec.id).state is SandboxState.GONE  # type: ignore[union-attr]
    with pytest.raises(SandboxNotFound):
        await mgr.kill(rec.id)


async def test_concurrent_kills_are_serialised_and_only_one_wins(mgr: SandboxManager) -> None:
    rec = await mgr.create(CreateSpec("base", timeout=60))
    results = await asyncio.gather(*(mgr.kill(rec.id) for _ in range(5)), return_exceptions=True)
    assert sum(r is None for r in results) == 1
    assert all(isinstance(r, SandboxNotFound) for r in results if r is not None)


async def test_timeout_change_racing_a_kill_never_resurrects(mgr: SandboxManager) -> None:
    rec = await mgr.create(CreateSpec("base", timeout=60))
    results = await asyncio.gather(
        mgr.kill(rec.id), mgr.set_timeout(rec.id, 600), return_exceptions=True
    )
    assert results[0] is None
    assert results[1] is None or isinstance(results[1], SandboxNotFound)
    assert mgr.store.get(rec.id).state is SandboxState.GONE  # type: ignore[union-attr]


def test_compare_and_set_refuses_a_stale_expected_state(tmp_path: Path) -> None:
    store = Store(tmp_path / "db.sqlite")
    rec = SandboxRecord(
        id="iabc",
        template="base",
        alias="base",
        state=SandboxState.RUNNING,
        started_at=time.time(),
        end_at=time.time() + 60,
        cpu=1,
        memory_mb=512,
        disk_mb=1024,
        envd_version="0.6.4",
    )
    store.insert(rec)
    assert store.transition("iabc", SandboxState.RUNNING, SandboxState.PAUSING)
    assert not store.transition("iabc", SandboxState.RUNNING, SandboxState.KILLING)
    assert store.get("iabc").state is SandboxState.PAUSING  # type: ignore[union-attr]


async def test_failed_init_tears_the_sandbox_down(tmp_path: Path) -> None:
    runtime = BrokenInitRuntime(tmp_path / "run", default_user="root")
    m = _manager(tmp_path, runtime)
    await m.start()
    try:
        with pytest.raises(CreateFailed):
            await m.create(CreateSpec("base", timeout=60))
        # The envd process that did start was stopped and nothing is left in a live state.
        assert not _alive(runtime.last_pid)
        assert runtime._procs == {}
        rows = m.store.select()
        assert [r.state for r in rows] == [SandboxState.GONE]
        assert any("create failed" in ln.message for ln in m.store.logs(rows[0].id))
        assert m.metrics.create_failures._value.get() == 1
    finally:
        await m.close()


async def test_bad_input_creates_nothing(mgr: SandboxManager) -> None:
    with pytest.raises(TemplateNotFound):
        await mgr.create(CreateSpec("nope"))
    with pytest.raises(BadRequest):
        await mgr.create(CreateSpec("base", cpu=99))
    with pytest.raises(BadRequest):
        await mgr.create(CreateSpec("base", memory_mb=1))
    assert mgr.store.select() == []


async def test_pause_unsupported_rolls_back_to_running(mgr: SandboxManager) -> None:
    rec = await mgr.create(CreateSpec("base", timeout=60))
    with pytest.raises(NotSupported, match="snapshot"):
        await mgr.pause(rec.id)
    assert mgr.get(rec.id).state is SandboxState.RUNNING
    with pytest.raises(Conflict):
        await mgr.resume(rec.id, None)
    await mgr.kill(rec.id)


async def test_expiry_kills_and_auto_pause_falls_back_to_kill(mgr: SandboxManager) -> None:
    plain = await mgr.create(CreateSpec("base", timeout=1))
    paused = await mgr.create(CreateSpec("base", timeout=1, auto_pause=True))
    pids = [_envd_pid(mgr, plain), _envd_pid(mgr, paused)]
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        states = {mgr.store.get(r.id).state for r in (plain, paused)}  # type: ignore[union-attr]
        if states == {SandboxState.GONE}:
            break
        await asyncio.sleep(0.1)
    assert states == {SandboxState.GONE}
    assert not any(_alive(p) for p in pids)
    assert any("auto-pause unavailable" in ln.message for ln in mgr.store.logs(paused.id))


async def test_restart_marks_rows_of_vanished_sandboxes_gone(tmp_path: Path) -> None:
    m = _manager(tmp_path)
    await m.start()
    rec = await m.create(CreateSpec("base", timeout=60))
    # Simulate a crash: the runtime's processes die without the manager noticing.
    await m.runtime.close()
    m2 = _manager(tmp_path)
    await m2.start()
    try:
        assert m2.store.get(rec.id).state is SandboxState.GONE  # type: ignore[union-attr]
        assert any("marked gone" in ln.message for ln in m2.store.logs(rec.id))
    finally:
        await m2.close()
        await m._http.aclose()
