"""Rows a dead control-plane replica left half-done are settled by a live one
(`control.ownership`, `SandboxManager.sweep_orphans`), on a real etcd (the package's
3-member cluster), replicas' real leases, and an in-memory runtime standing in for the nodes.

No VMs. Each replica here is a `SandboxManager(shared=True)` with its own etcd client, store
and `ReplicaLease`, sharing one key prefix and one runtime, as processes share etcd and nodes.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
import pytest_asyncio
from cluster.etcd_cluster import EtcdCluster
from noderpc.memruntime import Held, MemoryRuntime

from agentenv.cluster.etcd import Etcd
from agentenv.cluster.replicas import ReplicaLease
from agentenv.contract.runtime import SandboxSpec
from agentenv.control.etcd_store import EtcdStore
from agentenv.control.sandboxes import SandboxManager
from agentenv.control.sqlite_store import SqliteStore
from agentenv.control.store import SandboxRecord, SandboxState

pytestmark = pytest.mark.asyncio(loop_scope="session")

TTL_S = 2
GRACE_S = 0.5
TRANSITIONS = (
    SandboxState.CREATING,
    SandboxState.PAUSING,
    SandboxState.RESUMING,
    SandboxState.KILLING,
)


class Cluster:
    """One prefix in the test etcd: replicas (managers) on it, and leases of dead ones."""

    def __init__(self, endpoints: str) -> None:
        self.endpoints = endpoints
        self.prefix = f"/agentenv-test-{uuid.uuid4().hex[:10]}/"
        self.runtime = MemoryRuntime()
        self.managers: list[SandboxManager] = []
        self.etcds: list[Etcd] = []

    def etcd(self) -> Etcd:
        client = Etcd(self.endpoints, prefix=self.prefix)
        self.etcds.append(client)
        return client

    async def replica(self, *, period_s: float = 0.2, grace_s: float = GRACE_S) -> SandboxManager:
        etcd = self.etcd()
        mgr = SandboxManager(
            EtcdStore(etcd),
            self.runtime,
            _NO_TEMPLATES,
            envd_version="0.6.4",
            shared=True,
            replicas=ReplicaLease(etcd, ttl_s=TTL_S),
            sweep_period_s=period_s,
            sweep_grace_s=grace_s,
        )
        await mgr.start()
        self.managers.append(mgr)
        return mgr

    async def dead_replica(self) -> str:
        """A replica that registered and then died (no more beats, no revoke): its id, once
        its lease has lapsed."""
        lease = ReplicaLease(self.etcd(), ttl_s=TTL_S)
        await lease.start()
        await lease.stop(deregister=False)
        await _wait(lambda: _gone(lease), TTL_S + 4)
        return lease.replica_id

    async def close(self) -> None:
        for mgr in self.managers:
            await mgr.close()
        for etcd in self.etcds:
            await etcd.close()


_NO_TEMPLATES: Any = object()  # no test here creates through the manager


async def _gone(lease: ReplicaLease) -> bool:
    return lease.replica_id not in await lease.live()


async def _wait(condition: Callable[[], Awaitable[bool]], timeout_s: float) -> float:
    started = time.monotonic()
    while not await condition():
        assert time.monotonic() - started < timeout_s, f"not within {timeout_s} s"
        await asyncio.sleep(0.05)
    return time.monotonic() - started


@pytest_asyncio.fixture(loop_scope="session")
async def cluster(etcd_cluster: EtcdCluster) -> AsyncIterator[Cluster]:
    etcd_cluster.ensure_running()
    c = Cluster(etcd_cluster.endpoints)
    try:
        yield c
    finally:
        await c.close()


def _row(sandbox_id: str, state: SandboxState, replica_id: str | None) -> SandboxRecord:
    now = time.time()
    return SandboxRecord(
        id=sandbox_id,
        template="base",
        alias="base",
        state=state,
        started_at=now,
        end_at=now + 300,
        cpu=1,
        memory_mb=512,
        disk_mb=1024,
        envd_version="0.6.4",
        envd_token="tok",
        address="198.18.0.9" if state is not SandboxState.CREATING else None,
        envd_url="http://envd" if state is not SandboxState.CREATING else None,
        replica_id=replica_id,
    )


def _hold(runtime: MemoryRuntime, sandbox_id: str, state: str = "running") -> None:
    spec = SandboxSpec(sandbox_id, "base", 1, 512, envd_token="tok")
    runtime.held[sandbox_id] = Held(spec, state=state)


async def _state(mgr: SandboxManager, sandbox_id: str) -> SandboxState | None:
    rec = await mgr.store.get(sandbox_id)
    return None if rec is None else rec.state


async def _logs(mgr: SandboxManager, sandbox_id: str) -> list[str]:
    return [line.message for line in await mgr.store.logs(sandbox_id)]


@pytest.mark.parametrize(
    ("node_state", "settled"),
    [("running", SandboxState.RUNNING), ("paused", SandboxState.PAUSED)],
)
async def test_a_row_left_pausing_by_a_gone_replica_is_settled_by_a_live_one(
    cluster: Cluster, node_state: str, settled: SandboxState
) -> None:
    live = await cluster.replica()
    dead = await cluster.dead_replica()
    sid = f"i{uuid.uuid4().hex[:19]}"
    # The dead replica had moved the row to pausing; the node got as far as `node_state`.
    _hold(cluster.runtime, sid, node_state)
    await live.store.insert(_row(sid, SandboxState.PAUSING, dead))

    async def done() -> bool:
        rec = await live.store.get(sid)
        return rec is not None and rec.state is settled

    took = await _wait(done, 10)
    # Seen orphaned for the grace, then settled at a sweep: well within a few periods.
    assert GRACE_S <= took < GRACE_S + 3
    rec = await live.store.get(sid)
    assert rec is not None and rec.replica_id == live.replica_id
    logs = await _logs(live, sid)
    assert any(f"after its replica {dead} was gone (was pausing)" in m for m in logs), logs
    if settled is SandboxState.PAUSED:
        assert rec.address is None and rec.pause_mode == "full"
    else:
        assert rec.address is not None and rec.pause_mode is None
        # Usable as any running row: it pauses again through the live replica.
        await live.pause(sid)
        assert cluster.runtime.held[sid].state == "paused"


async def test_rows_of_live_replicas_and_fresh_orphans_are_left_alone(cluster: Cluster) -> None:
    sweeper = await cluster.replica(period_s=3600, grace_s=1.0)
    other = await cluster.replica(period_s=3600)
    dead = await cluster.dead_replica()
    mine, theirs = f"i{uuid.uuid4().hex[:19]}", f"i{uuid.uuid4().hex[:19]}"
    orphan = f"i{uuid.uuid4().hex[:19]}"
    for sid in (mine, theirs, orphan):
        _hold(cluster.runtime, sid)
    await sweeper.store.insert(_row(mine, SandboxState.PAUSING, sweeper.replica_id))
    await sweeper.store.insert(_row(theirs, SandboxState.RESUMING, other.replica_id))
    await sweeper.store.insert(_row(orphan, SandboxState.KILLING, dead))
    finds_before = sum(1 for name, _ in cluster.runtime.calls if name == "find")
    # The first sight of an orphan starts its grace; nothing is touched before it ends.
    assert await sweeper.sweep_orphans() == []
    assert await sweeper.sweep_orphans() == []
    await asyncio.sleep(1.1)
    assert await sweeper.sweep_orphans() == [orphan]
    for _ in range(3):
        assert await sweeper.sweep_orphans() == []
    states = {sid: await _state(sweeper, sid) for sid in (mine, theirs, orphan)}
    assert states == {
        mine: SandboxState.PAUSING,
        theirs: SandboxState.RESUMING,
        orphan: SandboxState.GONE,
    }
    # Only the orphan's sandbox was asked about, and it was deleted (a kill finished).
    asked = [args[0] for name, args in cluster.runtime.calls if name == "find"]
    assert asked[finds_before:] == [orphan]
    assert mine in cluster.runtime.held and orphan not in cluster.runtime.held
    assert f"killed (finished after its replica {dead} was gone)" in await _logs(sweeper, orphan)


async def test_two_sweepers_at_once_settle_each_row_once(cluster: Cluster) -> None:
    a = await cluster.replica(period_s=3600, grace_s=0)
    b = await cluster.replica(period_s=3600, grace_s=0)
    dead = await cluster.dead_replica()
    rows = {f"i{uuid.uuid4().hex[:19]}": state for state in TRANSITIONS for _ in range(2)}
    for sid, state in rows.items():
        _hold(cluster.runtime, sid)
        # A create's row names no runtime id yet: its sandbox goes by the row's id.
        await a.store.insert(_row(sid, state, dead))
    cluster.runtime.calls.clear()
    got_a, got_b = await asyncio.gather(a.sweep_orphans(), b.sweep_orphans())
    # Each row was settled by exactly one of them.
    assert sorted(got_a + got_b) == sorted(rows), (got_a, got_b)
    assert not set(got_a) & set(got_b)
    deletes = [str(args[0]) for name, args in cluster.runtime.calls if name == "delete"]
    killed = [sid for sid, s in rows.items() if s in (SandboxState.CREATING, SandboxState.KILLING)]
    assert sorted(deletes) == sorted(killed)
    for sid, state in rows.items():
        rec = await a.store.get(sid)
        assert rec is not None
        expect = SandboxState.GONE if sid in killed else SandboxState.RUNNING
        assert rec.state is expect, (sid, state, rec.state)
        settled_lines = [m for m in await _logs(a, sid) if "was gone" in m]
        assert len(settled_lines) == 1, settled_lines
    # A resume cut short gets envd's /init again, once per row.
    specs = [a for name, args in cluster.runtime.calls if name == "init_guest" for a in args[:1]]
    inits = sorted(spec.sandbox_id for spec in specs if isinstance(spec, SandboxSpec))
    assert inits == sorted(sid for sid, s in rows.items() if s is SandboxState.RESUMING)
    # Nothing is left for a later sweep.
    assert await a.sweep_orphans() == [] and await b.sweep_orphans() == []


async def test_one_server_stamps_nothing_and_reconciles_at_start(tmp_path: Any) -> None:
    """The single-node path: no replica id on its rows, `_reconcile` at start as before."""
    runtime = MemoryRuntime()
    store = SqliteStore(tmp_path / "db.sqlite")
    sid = f"i{uuid.uuid4().hex[:19]}"
    _hold(runtime, sid, "paused")
    await store.insert(_row(sid, SandboxState.PAUSING, None))
    mgr = SandboxManager(store, runtime, _NO_TEMPLATES, envd_version="0.6.4")
    await mgr.start()
    try:
        assert mgr.replica_id is None
        rec = await store.get(sid)
        assert rec is not None and rec.state is SandboxState.PAUSED and rec.replica_id is None
        assert "paused, as a restarted server found it (was pausing)" in await _logs(mgr, sid)
        await mgr.resume(sid, 60)
        await mgr.pause(sid)
        rec = await store.get(sid)
        assert rec is not None and rec.replica_id is None
        assert await mgr.sweep_orphans() == []
    finally:
        await mgr.close()


async def test_a_takeover_that_fails_is_given_back_and_tried_again(cluster: Cluster) -> None:
    live = await cluster.replica(period_s=3600, grace_s=0)
    dead = await cluster.dead_replica()
    sid = f"i{uuid.uuid4().hex[:19]}"
    _hold(cluster.runtime, sid)
    await live.store.insert(_row(sid, SandboxState.RESUMING, dead))
    # The node does not answer the first question (a timeout, an RPC error).
    cluster.runtime.fail = TimeoutError("node did not answer")
    assert await live.sweep_orphans() == []
    rec = await live.store.get(sid)
    # Not lost, not stuck under the live replica's stamp: as the dead one left it.
    assert rec is not None and (rec.state, rec.replica_id) == (SandboxState.RESUMING, dead)
    assert await live.sweep_orphans() == [sid]
    assert await _state(live, sid) is SandboxState.RUNNING
