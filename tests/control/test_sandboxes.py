"""The sandbox state machine with real microVMs (`NodeRuntime`) behind it.

Tests marked `vm` boot sandboxes, never more than two at a time; each test that is about a
create or a kill boots its own, since that is what it checks.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import httpx
import pytest

from agentenv.config import Settings
from agentenv.contract.errors import (
    BadRequest,
    Conflict,
    CreateFailed,
    NotSupported,
    OperationFailed,
    SandboxLost,
    SandboxNotFound,
    TemplateNotFound,
)
from agentenv.contract.runtime import Placement, SandboxSpec
from agentenv.control.sandbox_base import CreateSpec
from agentenv.control.sandboxes import SandboxManager
from agentenv.control.sqlite_store import SqliteStore
from agentenv.control.store import SandboxRecord, SandboxState, Store
from agentenv.guest.envd.client import EnvdClient
from agentenv.node.runtime import CatalogTemplates, NodeRuntime


class RowFlippingRuntime(NodeRuntime):
    """Boots a real sandbox, and before handing it back moves the sandbox's row out of
    `creating` (as a concurrent kill would): the create then fails after a VM exists, the
    fault a manager must tear down."""

    last_pid: int | None = None
    store: Store | None = None

    async def create(self, spec: SandboxSpec) -> Placement:
        placed = await super().create(spec)
        self.last_pid = self.node.get(placed.sandbox_id).pid
        assert self.store is not None
        await self.store.transition(spec.sandbox_id, SandboxState.CREATING, SandboxState.KILLING)
        return placed


class VanishingTemplateRuntime(NodeRuntime):
    """Resets to a template the node does not hold: the race of a reset with a delete of its
    target, between the control plane's check and the node's (which a test cannot time).
    The node refuses it before touching the guest."""

    async def reset(self, spec: SandboxSpec) -> Placement:
        return await super().reset(replace(spec, template="deleted-meanwhile"))


def _manager(settings: Settings, db: Path, runtime: NodeRuntime | None = None) -> SandboxManager:
    return SandboxManager(
        SqliteStore(db),
        runtime or NodeRuntime(settings),
        CatalogTemplates(settings),
        envd_version="0.6.4",
    )


@pytest.fixture
async def mgr(
    settings: Settings, base_template: object, tmp_path: Path
) -> AsyncIterator[SandboxManager]:
    m = _manager(settings, tmp_path / "db.sqlite")
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


def _node_runtime(mgr: SandboxManager) -> NodeRuntime:
    assert isinstance(mgr.runtime, NodeRuntime)
    return mgr.runtime


def _qemu_pid(mgr: SandboxManager, rec: SandboxRecord) -> int:
    pid = _node_runtime(mgr).node.get(rec.id).pid
    assert pid is not None
    return pid


def _released(mgr: SandboxManager, pid: int) -> bool:
    """The VM's process is gone and the node holds no sandbox (slot, upper, cgroup freed)."""
    return not _alive(pid) and _node_runtime(mgr).node.list() == []


@pytest.mark.vm
async def test_create_inits_envd_and_kill_releases_it(mgr: SandboxManager) -> None:
    rec = await mgr.create(CreateSpec("base", timeout=60, env_vars={"FOO": "bar"}))
    assert rec.state is SandboxState.RUNNING and rec.address and rec.envd_token
    assert rec.address.startswith("198.18.")
    pid = _qemu_pid(mgr, rec)
    async with httpx.AsyncClient(trust_env=False, timeout=30) as http:
        # /init set the access token: envd now refuses requests without it.
        envs = await http.get(f"{rec.envd_url}/envs")
        assert envs.status_code == 401
        envs = await http.get(f"{rec.envd_url}/envs", headers={"X-Access-Token": rec.envd_token})
        assert envs.json()["FOO"] == "bar"
    reads: list[str] = []
    get = mgr.store.get

    async def counted(sandbox_id: str) -> SandboxRecord | None:
        reads.append(sandbox_id)
        return await get(sandbox_id)

    mgr.store.get = counted  # type: ignore[method-assign]
    await mgr.kill(rec.id)
    mgr.store.get = get  # type: ignore[method-assign]
    # One read of the row, under its lock; the lock goes with the sandbox without another.
    assert reads == [rec.id] and rec.id not in mgr._locks and not mgr._ended
    assert _released(mgr, pid)
    assert (await mgr.store.get(rec.id)).state is SandboxState.GONE  # type: ignore[union-attr]
    with pytest.raises(SandboxNotFound):
        await mgr.kill(rec.id)


@pytest.mark.vm
async def test_create_after_kill_reuses_the_slot_address(mgr: SandboxManager) -> None:
    """A freed slot's address goes to the next sandbox at once (create is a ~1 s restore):
    nothing may reach the new VM over a connection pooled for the previous one."""
    addresses = []
    for _ in range(2):
        first = await mgr.create(CreateSpec("base", timeout=60))
        await mgr.kill(first.id)
        rec = await mgr.create(CreateSpec("base", timeout=60))
        addresses += [first.address, rec.address]
        assert rec.envd_token
        async with EnvdClient(rec.envd_url, access_token=rec.envd_token) as envd:
            assert (await envd.run("echo ok", timeout=30)).stdout == "ok\n"
        await mgr.kill(rec.id)
    assert len(set(addresses)) < len(addresses), f"no slot address was reused: {addresses}"


@pytest.mark.vm
async def test_concurrent_kills_are_serialised_and_only_one_wins(mgr: SandboxManager) -> None:
    rec = await mgr.create(CreateSpec("base", timeout=60))
    pid = _qemu_pid(mgr, rec)
    results = await asyncio.gather(*(mgr.kill(rec.id) for _ in range(5)), return_exceptions=True)
    assert sum(r is None for r in results) == 1
    assert all(isinstance(r, SandboxNotFound) for r in results if r is not None)
    assert rec.id not in mgr._locks and not mgr._ended
    assert _released(mgr, pid)


@pytest.mark.vm
async def test_timeout_change_racing_a_kill_never_resurrects(mgr: SandboxManager) -> None:
    rec = await mgr.create(CreateSpec("base", timeout=60))
    results = await asyncio.gather(
        mgr.kill(rec.id), mgr.set_timeout(rec.id, 600), return_exceptions=True
    )
    assert results[0] is None
    assert results[1] is None or isinstance(results[1], SandboxNotFound)
    assert (await mgr.store.get(rec.id)).state is SandboxState.GONE  # type: ignore[union-attr]
    assert _node_runtime(mgr).node.list() == []


async def test_compare_and_set_refuses_a_stale_expected_state(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "db.sqlite")
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
    await store.insert(rec)
    assert await store.transition("iabc", SandboxState.RUNNING, SandboxState.PAUSING)
    assert not await store.transition("iabc", SandboxState.RUNNING, SandboxState.KILLING)
    assert (await store.get("iabc")).state is SandboxState.PAUSING  # type: ignore[union-attr]


@pytest.mark.vm
async def test_a_create_failing_after_its_vm_exists_is_torn_down(
    settings: Settings, base_template: object, tmp_path: Path
) -> None:
    runtime = RowFlippingRuntime(settings)
    m = _manager(settings, tmp_path / "db.sqlite", runtime)
    runtime.store = m.store
    await m.start()
    try:
        with pytest.raises(CreateFailed, match="left 'creating' unexpectedly"):
            await m.create(CreateSpec("base", timeout=60))
        # The VM that did boot was stopped and nothing is left in a live state.
        assert runtime.last_pid is not None
        assert _released(m, runtime.last_pid)
        rows = await m.store.select()
        assert [r.state for r in rows] == [SandboxState.GONE]
        assert any("create failed" in ln.message for ln in await m.store.logs(rows[0].id))
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
    with pytest.raises(BadRequest):
        await mgr.create(CreateSpec("base", disk_mb=1))
    assert await mgr.store.select() == []
    assert _node_runtime(mgr).node.list() == []


async def _wait_states(
    mgr: SandboxManager, want: dict[str, SandboxState], timeout_s: float = 15
) -> dict[str, SandboxState]:
    deadline = time.monotonic() + timeout_s
    while True:
        got = {sid: (await mgr.store.get(sid)).state for sid in want}  # type: ignore[union-attr]
        if got == want or time.monotonic() > deadline:
            return got
        await asyncio.sleep(0.1)


@pytest.mark.vm
async def test_pause_and_resume_keep_the_guest_running_where_it_was(
    mgr: SandboxManager,
) -> None:
    rec = await mgr.create(CreateSpec("base", timeout=60, env_vars={"FOO": "bar"}))
    assert rec.envd_token and rec.envd_url
    pid = _qemu_pid(mgr, rec)
    # /tmp is a tmpfs: only a memory snapshot brings the file back.
    async with EnvdClient(rec.envd_url, access_token=rec.envd_token) as guest:
        assert (await guest.run("echo $FOO > /tmp/mark")).exit_code == 0
    with pytest.raises(Conflict):
        await mgr.resume(rec.id, None)
    await mgr.pause(rec.id)
    assert (await mgr.get(rec.id)).state is SandboxState.PAUSED
    assert not _alive(pid)
    with pytest.raises(Conflict):
        await mgr.pause(rec.id)
    back = await mgr.resume(rec.id, 60)
    assert back.state is SandboxState.RUNNING and back.envd_url
    async with EnvdClient(back.envd_url, access_token=rec.envd_token) as guest:
        assert (await guest.run("cat /tmp/mark")).stdout == "bar\n"
    await mgr.kill(rec.id)
    node = _node_runtime(mgr).node
    assert node.list() == []
    assert not (node.settings.sandboxes_dir / rec.id).exists()


@pytest.mark.vm
async def test_a_pause_whose_vm_dies_says_so_and_the_sandbox_is_lost(
    mgr: SandboxManager,
) -> None:
    rec = await mgr.create(CreateSpec("base", timeout=60))
    pid = _qemu_pid(mgr, rec)
    # RAM worth saving, so the pause's stream is still being written when QEMU dies.
    async with EnvdClient(rec.envd_url, access_token=rec.envd_token) as guest:
        fill = await guest.run("head -c 40000000 /dev/urandom > /tmp/fill", user="root")
        assert fill.exit_code == 0
    pause = asyncio.create_task(mgr.pause(rec.id))
    for _ in range(2000):
        if (await mgr.get(rec.id)).state is SandboxState.PAUSING:
            break
        await asyncio.sleep(0.005)
    os.kill(pid, signal.SIGKILL)
    # Not "internal error: SandboxError": what failed, and why.
    with pytest.raises(OperationFailed, match=f"sandbox {rec.id} was not paused: .+QEMU exited"):
        await pause
    assert await _wait_states(mgr, {rec.id: SandboxState.GONE}) == {rec.id: SandboxState.GONE}
    assert _released(mgr, pid)


@pytest.mark.vm
async def test_a_reset_the_node_refuses_leaves_the_sandbox_running(
    settings: Settings, base_template: object, tmp_path: Path
) -> None:
    m = _manager(settings, tmp_path / "db.sqlite", VanishingTemplateRuntime(settings))
    await m.start()
    try:
        rec = await m.create(CreateSpec("base", timeout=60))
        pid = _qemu_pid(m, rec)
        assert rec.envd_url
        async with EnvdClient(rec.envd_url, access_token=rec.envd_token) as guest:
            assert (await guest.run("echo kept > /tmp/mark")).exit_code == 0
        with pytest.raises(TemplateNotFound, match="deleted-meanwhile"):
            await m.reset(rec.id)
        after = await m.get(rec.id)
        assert after.state is SandboxState.RUNNING and after.reset_to is None
        assert (after.envd_url, after.end_at) == (rec.envd_url, rec.end_at)
        assert _qemu_pid(m, after) == pid
        async with EnvdClient(rec.envd_url, access_token=rec.envd_token) as guest:
            assert (await guest.run("cat /tmp/mark")).stdout == "kept\n"
        await m.kill(rec.id)
    finally:
        await m.close()


@pytest.mark.vm
async def test_without_snapshots_pause_rolls_back_and_auto_pause_kills(
    settings: Settings, base_template: object, tmp_path: Path
) -> None:
    # A node with snapshots switched off (AGENTENV_SNAPSHOTS=0) cold-boots and cannot pause.
    m = _manager(settings, tmp_path / "db.sqlite", NodeRuntime(replace(settings, snapshots=False)))
    await m.start()
    try:
        rec = await m.create(CreateSpec("base", timeout=60, auto_pause=True))
        pid = _qemu_pid(m, rec)
        with pytest.raises(NotSupported, match="snapshot"):
            await m.pause(rec.id)
        assert (await m.get(rec.id)).state is SandboxState.RUNNING
        # Still the same live VM, still answering.
        assert _alive(pid) and await _node_runtime(m).is_alive(rec.id)
        async with httpx.AsyncClient(trust_env=False, timeout=30) as http:
            assert (await http.get(f"{rec.envd_url}/health")).status_code == 204
        with pytest.raises(Conflict):
            await m.resume(rec.id, None)
        # At its timeout it would be paused; since it cannot be, it is killed.
        await m.set_timeout(rec.id, 1)
        assert await _wait_states(m, {rec.id: SandboxState.GONE}) == {rec.id: SandboxState.GONE}
        assert _released(m, pid)
        assert any("auto-pause unavailable" in ln.message for ln in await m.store.logs(rec.id))
    finally:
        await m.close()


@pytest.mark.vm
async def test_expiry_kills_or_pauses(mgr: SandboxManager) -> None:
    plain = await mgr.create(CreateSpec("base", timeout=1))
    pids = [_qemu_pid(mgr, plain)]
    paused = await mgr.create(CreateSpec("base", timeout=1, auto_pause=True))
    pids.append(_qemu_pid(mgr, paused))
    want = {plain.id: SandboxState.GONE, paused.id: SandboxState.PAUSED}
    assert await _wait_states(mgr, want) == want
    assert not any(_alive(p) for p in pids)
    assert any("paused on timeout" in ln.message for ln in await mgr.store.logs(paused.id))
    assert any("killed on timeout" in ln.message for ln in await mgr.store.logs(plain.id))
    # A paused sandbox is not expired again; killing it frees what it kept on disk.
    await mgr.kill(paused.id)
    assert _node_runtime(mgr).node.list() == []


@pytest.mark.vm
async def test_restart_marks_rows_of_vanished_sandboxes_lost(
    settings: Settings, base_template: object, tmp_path: Path
) -> None:
    db = tmp_path / "db.sqlite"
    m = _manager(settings, db)
    await m.start()
    rec = await m.create(CreateSpec("base", timeout=60))
    pid = _qemu_pid(m, rec)
    # Simulate a crash: the VMs go away without the manager noticing.
    await m.runtime.close()
    assert not _alive(pid)
    m2 = _manager(settings, db)
    await m2.start()
    try:
        assert (await m2.store.get(rec.id)).state is SandboxState.GONE  # type: ignore[union-attr]
        assert any(ln.message.startswith("lost: ") for ln in await m2.store.logs(rec.id))
        with pytest.raises(SandboxLost, match=f"sandbox {rec.id} was lost"):
            await m2.get(rec.id)
    finally:
        await m2.close()
