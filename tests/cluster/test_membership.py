"""Node registration, heartbeats, death by lease, re-registration, cordons, the join/leave
watch; against a real 3-member etcd."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from pathlib import Path

import pytest

from agentenv.cluster.etcd import Etcd
from agentenv.cluster.leases import DuplicateMember
from agentenv.cluster.locations import Locations
from agentenv.cluster.membership import Load, Membership, NodeEvent, NodeInfo, NodeRegistration

from .etcd_cluster import EtcdCluster
from .helpers import node_info, registered, wait_until

# grpc.aio delivers completions to the loop a call started on; one loop for every test here
# (see conftest.py).
pytestmark = pytest.mark.asyncio(loop_scope="session")

TTL_S = 2
# etcd checks for expired leases every 500 ms; a loaded 2-core host adds scheduling delay.
EXPIRY_MARGIN_S = 2.0
REGISTER_SCRIPT = Path(__file__).with_name("register_node.py")


async def test_register_list_get(etcd: Etcd) -> None:
    members = Membership(etcd)
    a = await registered(etcd, "node-a")
    b = await registered(etcd, "node-b")
    try:
        nodes = await members.list_nodes()
        assert [n.node_id for n in nodes] == ["node-a", "node-b"]
        assert all(n.ready and not n.cordoned for n in nodes)
        got = await members.get_node("node-a")
        assert got is not None
        assert got.capacity.slots == 16 and got.rpc_url.endswith("/node-a")
        assert got.load.updated_at > time.time() - 30
        assert await members.get_node("node-zzz") is None
    finally:
        await a.stop()
        await b.stop()
    # stop() revokes the lease: gone at once, not after a TTL.
    assert await members.list_nodes() == []


async def test_heartbeat_keeps_node_alive_and_publishes_load(etcd: Etcd) -> None:
    members = Membership(etcd)
    running = [0]

    def load() -> Load:
        return Load(free_memory_mb=1000 - running[0], running=running[0], free_slots=16)

    a = await registered(etcd, "node-a", ttl_s=TTL_S)
    a.load_source = load
    try:
        first = await members.get_node("node-a")
        assert first is not None
        running[0] = 3
        await asyncio.sleep(TTL_S * 2.5)
        later = await members.get_node("node-a")
        assert later is not None, "heartbeats did not keep the lease alive past its TTL"
        assert later.load.running == 3 and later.load.free_memory_mb == 997
        assert later.load.updated_at > first.load.updated_at
        assert a.registrations == 1
    finally:
        await a.stop()


async def test_stopped_heartbeat_node_vanishes_within_ttl(etcd: Etcd) -> None:
    members = Membership(etcd)
    a = await registered(etcd, "node-a", ttl_s=TTL_S)
    await a.stop(deregister=False)  # the heartbeat task is cancelled; the lease is left to lapse
    gone_after = await wait_until(
        lambda: _absent(members, "node-a"), timeout_s=TTL_S + EXPIRY_MARGIN_S
    )
    assert await members.get_node("node-a") is None
    print(f"node gone {gone_after:.2f} s after its last heartbeat (ttl {TTL_S} s)")


async def _absent(members: Membership, node_id: str) -> bool:
    return await members.get_node(node_id) is None


async def _start_agent(
    etcd_cluster: EtcdCluster, prefix: str, node_id: str, stderr_path: Path
) -> asyncio.subprocess.Process:
    with stderr_path.open("wb") as stderr:
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            str(REGISTER_SCRIPT),
            etcd_cluster.endpoints,
            prefix,
            node_id,
            str(TTL_S),
            stdout=asyncio.subprocess.PIPE,
            stderr=stderr,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        )
    assert process.stdout is not None
    try:
        line = await asyncio.wait_for(process.stdout.readline(), 30)
    except TimeoutError:
        process.kill()
        await process.wait()
        log = await asyncio.to_thread(stderr_path.read_text)
        raise AssertionError(f"agent did not register: {log}") from None
    if not line.startswith(b"registered "):
        log = await asyncio.to_thread(stderr_path.read_text)
        raise AssertionError(f"agent said {line!r}: {log}")
    return process


async def test_sigkilled_agent_vanishes_with_its_locations(
    etcd: Etcd, etcd_cluster: EtcdCluster, prefix: str, tmp_path: Path
) -> None:
    members = Membership(etcd)
    locations = Locations(etcd)
    agent = await _start_agent(etcd_cluster, prefix, "node-k", tmp_path / "agent.log")
    try:
        assert [n.node_id for n in await members.list_nodes()] == ["node-k"]
        assert await locations.holders("template", "base") == ["node-k"]
        agent.kill()
        await agent.wait()
        gone_after = await wait_until(
            lambda: _absent(members, "node-k"), timeout_s=TTL_S + EXPIRY_MARGIN_S
        )
        assert await locations.holders("template", "base") == []
        print(f"SIGKILLed agent gone after {gone_after:.2f} s (ttl {TTL_S} s)")
    finally:
        if agent.returncode is None:
            agent.kill()
            await agent.wait()


async def test_agent_paused_past_ttl_registers_again(
    etcd: Etcd, etcd_cluster: EtcdCluster, prefix: str, tmp_path: Path
) -> None:
    members = Membership(etcd)
    log_path = tmp_path / "agent.log"
    agent = await _start_agent(etcd_cluster, prefix, "node-p", log_path)
    try:
        agent.send_signal(signal.SIGSTOP)
        await wait_until(lambda: _absent(members, "node-p"), timeout_s=TTL_S + EXPIRY_MARGIN_S)
        agent.send_signal(signal.SIGCONT)
        back_after = await wait_until(
            lambda: _present(members, "node-p"), timeout_s=TTL_S + EXPIRY_MARGIN_S
        )
        # It came back with the locations it held.
        assert await Locations(etcd).holders("template", "base") == ["node-p"]
        assert "was lost" in await asyncio.to_thread(log_path.read_text)
        print(f"paused agent registered again {back_after:.2f} s after SIGCONT")
    finally:
        agent.send_signal(signal.SIGCONT)
        agent.kill()
        await agent.wait()


async def _present(members: Membership, node_id: str) -> bool:
    return await members.get_node(node_id) is not None


async def test_lost_lease_registers_again(etcd: Etcd, caplog: pytest.LogCaptureFixture) -> None:
    members = Membership(etcd)
    a = await registered(etcd, "node-a", ttl_s=TTL_S)
    locations = Locations(etcd, a)
    await locations.add("snapshot", "snap-1")
    try:
        lost = a.lease_id
        with caplog.at_level(logging.WARNING, logger="agentenv.cluster.membership"):
            await etcd.revoke_lease(lost)  # as if etcd had lost it: the keys go with it
            await wait_until(_registrations(a, 2), timeout_s=a.interval_s + 2)
        assert a.lease_id != lost
        assert any("was lost" in r.getMessage() for r in caplog.records)
        assert await members.get_node("node-a") is not None
        # The location it held is back, under the new lease.
        assert await locations.holders("snapshot", "snap-1") == ["node-a"]
        location = await etcd.get(etcd.key("locations", "snapshot", "snap-1", "node-a"))
        assert location is not None and location.lease == a.lease_id
    finally:
        await a.stop()


def _registrations(registration: NodeRegistration, count: int) -> Callable[[], Awaitable[bool]]:
    async def reached() -> bool:
        return registration.registrations >= count

    return reached


async def test_cordon_survives_reregistration(etcd: Etcd) -> None:
    members = Membership(etcd)
    a = await registered(etcd, "node-a")
    await members.cordon("node-a", reason="maintenance")
    node = await members.get_node("node-a")
    assert node is not None and node.cordoned and not node.ready
    await a.stop()  # the agent goes away: its record, not its cordon
    assert [c.node_id for c in await members.cordons()] == ["node-a"]
    a = await registered(etcd, "node-a")
    b = await registered(etcd, "node-b")
    try:
        listed = {n.node_id: n for n in await members.list_nodes()}
        assert listed["node-a"].cordoned and not listed["node-b"].cordoned
        assert [n.node_id for n in await members.ready_nodes()] == ["node-b"]
        assert await members.uncordon("node-a")
        assert not await members.uncordon("node-a")
        assert [n.node_id for n in await members.ready_nodes()] == ["node-a", "node-b"]
    finally:
        await a.stop()
        await b.stop()


async def test_watch_reports_joins_and_leaves(etcd: Etcd) -> None:
    members = Membership(etcd)
    a = await registered(etcd, "node-a", ttl_s=TTL_S)
    events: list[NodeEvent] = []

    async def collect() -> None:
        async with members.watch() as watch:
            async for event in watch:
                events.append(event)

    collector = asyncio.create_task(collect())
    try:
        await wait_until(lambda: _has(events, "joined", "node-a"), timeout_s=5)
        b = await registered(etcd, "node-b", ttl_s=TTL_S)
        await wait_until(lambda: _has(events, "joined", "node-b"), timeout_s=5)
        await asyncio.sleep(TTL_S)  # heartbeats rewrite records: not joins
        await b.stop()
        await wait_until(lambda: _has(events, "left", "node-b"), timeout_s=5)
        await a.stop(deregister=False)
        await wait_until(lambda: _has(events, "left", "node-a"), timeout_s=TTL_S + EXPIRY_MARGIN_S)
        assert [(e.kind, e.node_id) for e in events] == [
            ("joined", "node-a"),
            ("joined", "node-b"),
            ("left", "node-b"),
            ("left", "node-a"),
        ]
        joined = events[1].info
        assert isinstance(joined, NodeInfo) and joined.node_id == "node-b"
    finally:
        await a.stop()
        collector.cancel()
        await asyncio.gather(collector, return_exceptions=True)


async def test_watch_stops_cleanly(etcd: Etcd) -> None:
    watch = Membership(etcd).watch()
    waiter = asyncio.create_task(anext(watch, None))
    await asyncio.sleep(0.5)  # the watch is open and waiting for events
    await watch.stop()
    assert await asyncio.wait_for(waiter, 5) is None


async def _has(events: list[NodeEvent], kind: str, node_id: str) -> bool:
    return any(e.kind == kind and e.node_id == node_id for e in events)


async def test_watch_reports_a_registration_under_a_new_lease_as_a_join(etcd: Etcd) -> None:
    """An agent restarted within its TTL writes its record under a new lease before the old
    one lapses: no leave, but a join (what it holds may have changed); its heartbeats not."""
    members = Membership(etcd)
    a = await registered(etcd, "node-a", ttl_s=TTL_S)
    events: list[NodeEvent] = []

    async def collect() -> None:
        async with members.watch() as watch:
            async for event in watch:
                events.append(event)

    collector = asyncio.create_task(collect())
    try:
        await wait_until(lambda: _has(events, "joined", "node-a"), timeout_s=5)
        await a.stop(deregister=False)
        again = await registered(etcd, "node-a", ttl_s=TTL_S)
        await wait_until(lambda: _joins(events, 2), timeout_s=5)
        # The first lease lapses (it holds no key now) and the new one beats: nothing more.
        await asyncio.sleep(TTL_S + EXPIRY_MARGIN_S)
        assert [(e.kind, e.node_id) for e in events] == [("joined", "node-a")] * 2
        await again.stop()
    finally:
        await a.stop()
        collector.cancel()
        await asyncio.gather(collector, return_exceptions=True)


async def _joins(events: list[NodeEvent], count: int) -> bool:
    return sum(1 for e in events if e.kind == "joined") == count


async def test_a_second_agent_with_the_same_node_id_is_refused(etcd: Etcd) -> None:
    """Two data dirs (instance tokens) under one node id: the second agent waits out one
    TTL (the first could be a dead run) and is refused while the first beats; a restart
    of the first (same token) takes its record over at once; once the first is gone, the
    other may register."""
    first = NodeRegistration(etcd, replace(node_info("dup"), instance="aaa"), ttl_s=2)
    await first.start()
    try:
        loop = asyncio.get_running_loop()
        started = loop.time()
        other = NodeRegistration(etcd, replace(node_info("dup"), instance="bbb"), ttl_s=2)
        with pytest.raises(DuplicateMember, match="AGENTENV_NODE_ID"):
            await other.start()
        assert 2.0 <= loop.time() - started < 6.0
        again = NodeRegistration(etcd, replace(node_info("dup"), instance="aaa"), ttl_s=2)
        await asyncio.wait_for(again.start(), 1.0)
        await again.stop()
    finally:
        await first.stop()
    await asyncio.wait_for(other.start(), 1.0)
    await other.stop()
