"""The client over all members: failover when the leader is SIGKILLed, deadlines against a
dead or frozen cluster, many concurrent callers; plus the settings that configure it."""

from __future__ import annotations

import asyncio
import time

import pytest

from agentenv.cluster.bindings import Bindings
from agentenv.cluster.etcd import CasConflict, ClusterUnavailable, Etcd, KeyValue, cas
from agentenv.cluster.membership import Membership, NodeEvent, NodeRegistration

from .etcd_cluster import EtcdCluster, free_port
from .helpers import node_info, registered, wait_until

# grpc.aio delivers completions to the loop a call started on; one loop for every test here
# (see conftest.py).
pytestmark = pytest.mark.asyncio(loop_scope="session")

# Slack over a call's deadline for the last attempt's cancellation and a loaded host.
DEADLINE_SLACK_S = 1.0


async def test_leader_sigkill_operations_continue(etcd_cluster: EtcdCluster, prefix: str) -> None:
    etcd_cluster.ensure_running()
    leader = etcd_cluster.leader()
    # The leader first: every call and the watch start on the member that is killed.
    order = [leader] + [m for m in etcd_cluster.members if m is not leader]
    etcd = Etcd(",".join(m.endpoint for m in order), prefix=prefix)
    bindings, members = Bindings(etcd), Membership(etcd)
    registration = NodeRegistration(etcd, node_info("node-a"), ttl_s=3)
    await registration.start()
    events: list[NodeEvent] = []
    watch = members.watch(include_existing=False)

    async def collect() -> None:
        async for event in watch:
            events.append(event)

    collector = asyncio.create_task(collect())
    node_b: NodeRegistration | None = None
    try:
        started = time.monotonic()
        killed_at: float | None = None
        iterations: list[tuple[float, float]] = []  # (start offset, seconds)
        i = 0
        while time.monotonic() - started < 8.0:
            if killed_at is None and time.monotonic() - started > 1.5:
                await asyncio.to_thread(etcd_cluster.kill, leader)
                killed_at = time.monotonic() - started
            begun = time.monotonic()
            assert await bindings.create(f"sb-{i}", "node-a")
            assert await bindings.get(f"sb-{i}") == "node-a"
            assert [n.node_id for n in await members.list_nodes()] == ["node-a"]
            iterations.append((begun - started, time.monotonic() - begun))
            i += 1
        assert killed_at is not None
        longest = max(seconds for _, seconds in iterations)
        after = [seconds for offset, seconds in iterations if offset > killed_at + longest]
        print(
            f"leader {leader.name} SIGKILLed at {killed_at:.2f} s; {len(iterations)} iterations "
            f"(create+get+list), longest stall {longest:.2f} s, {len(after)} iterations after it, "
            f"new leader {etcd_cluster.leader().name}"
        )
        assert longest < etcd.deadline_s
        assert len(after) >= 10, "operations did not continue after the re-election"
        assert len(await bindings.of_node("node-a")) == i
        # The heartbeat rode out the election (etcd extends leases on a leader change).
        assert await members.get_node("node-a") is not None
        # The watch moved to a live member and still reports joins.
        node_b = await registered(etcd, "node-b")

        async def b_joined() -> bool:
            return any(e.kind == "joined" and e.node_id == "node-b" for e in events)

        await wait_until(b_joined, timeout_s=5)
    finally:
        await watch.stop()
        await asyncio.wait_for(collector, 5)
        if node_b is not None:
            await node_b.stop()
        await registration.stop()
        await etcd.close()
        await asyncio.to_thread(etcd_cluster.restart, leader)


async def test_dead_endpoints_raise_cluster_unavailable_within_deadline() -> None:
    endpoints = [f"127.0.0.1:{free_port()}" for _ in range(3)]
    async with Etcd(",".join(endpoints), deadline_s=1.5) as etcd:
        started = time.monotonic()
        with pytest.raises(ClusterUnavailable) as raised:
            await etcd.get(etcd.key("x"))
        elapsed = time.monotonic() - started
        assert elapsed < 1.5 + DEADLINE_SLACK_S
        message = str(raised.value)
        assert all(endpoint in message for endpoint in endpoints), message
        assert "UNAVAILABLE" in message, message
        with pytest.raises(ClusterUnavailable):
            await NodeRegistration(etcd, node_info("node-a")).start()


async def test_frozen_cluster_raises_within_deadline(
    etcd_cluster: EtcdCluster, prefix: str
) -> None:
    """SIGSTOPped members accept connections (the kernel does) and never answer: the case a
    client without its own deadline hangs on."""
    etcd_cluster.ensure_running()
    async with Etcd(etcd_cluster.endpoints, prefix=prefix, deadline_s=2.0) as etcd:
        await etcd.put(etcd.key("warm"), b"1")  # channels are connected before the freeze
        await asyncio.to_thread(etcd_cluster.pause_all)
        try:
            started = time.monotonic()
            with pytest.raises(ClusterUnavailable) as raised:
                await etcd.put(etcd.key("x"), b"1")
            assert time.monotonic() - started < 2.0 + DEADLINE_SLACK_S
            assert "no answer in time" in str(raised.value)
        finally:
            await asyncio.to_thread(etcd_cluster.resume_all)
        await asyncio.to_thread(etcd_cluster.wait_healthy)
        await etcd.put(etcd.key("x"), b"2")
        got = await etcd.get(etcd.key("x"))
        assert got is not None and got.value == b"2"


async def test_client_recovers_after_whole_cluster_restart(
    etcd_cluster: EtcdCluster, prefix: str
) -> None:
    etcd_cluster.ensure_running()
    async with Etcd(etcd_cluster.endpoints, prefix=prefix, deadline_s=1.0) as etcd:
        await etcd.put(etcd.key("k"), b"before")
        for member in etcd_cluster.members:
            await asyncio.to_thread(etcd_cluster.kill, member)
        with pytest.raises(ClusterUnavailable):
            await etcd.get(etcd.key("k"))
        await asyncio.to_thread(etcd_cluster.ensure_running)
        # The same client, whose channels saw every member die, finds them again.
        got = await etcd.call("get", lambda c: c.get(etcd.key("k")), deadline_s=10.0)
        assert got is not None and got.value == b"before"


async def test_many_concurrent_callers(etcd: Etcd) -> None:
    count = 50
    members, bindings = Membership(etcd), Bindings(etcd)
    started = time.monotonic()

    async def one(i: int) -> tuple[NodeRegistration, bool]:
        registration = await registered(etcd, f"node-{i:02d}", ttl_s=5)
        assert await bindings.create(f"sb-{i:02d}", registration.info.node_id)
        return registration, await bindings.create("shared", registration.info.node_id)

    results = await asyncio.gather(*(one(i) for i in range(count)))
    elapsed = time.monotonic() - started
    try:
        assert sum(won for _, won in results) == 1
        assert len(await members.list_nodes()) == count
        placed = await bindings.all()
        assert len(placed) == count + 1
        winner = next(r.info.node_id for r, won in results if won)
        assert placed["shared"] == winner
        assert await bindings.of_node(winner) == sorted(["shared", f"sb-{winner[5:]}"])
        print(f"{count} concurrent register + 2 binds: {elapsed:.2f} s")
    finally:
        await asyncio.gather(*(r.stop() for r, _ in results))
    assert await members.list_nodes() == []


async def test_close_ends_open_watches(etcd_cluster: EtcdCluster, prefix: str) -> None:
    etcd_cluster.ensure_running()
    etcd = Etcd(etcd_cluster.endpoints, prefix=prefix)
    watch = etcd.watch_prefix(etcd.dir("w"), 1)
    waiter = asyncio.create_task(anext(watch, None))
    await etcd.put(etcd.key("w", "a"), b"1")
    first = await asyncio.wait_for(waiter, 5)
    assert first is not None and first.kind == "put" and first.kv.value == b"1"
    waiter = asyncio.create_task(anext(watch, None))
    await asyncio.sleep(0.2)
    await etcd.close()
    assert await asyncio.wait_for(waiter, 5) is None
    with pytest.raises(RuntimeError, match="closed"):
        await etcd.get(etcd.key("w", "a"))


async def test_cas_rereads_after_a_lost_race_and_is_bounded(
    etcd: Etcd, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The one compare-and-set loop (`cluster.etcd.cas`): a write lost to another writer
    reads again and is made over the new value; `change` returning None writes nothing; a
    key rewritten after every read ends in `CasConflict` after the attempts or the
    deadline."""
    key = etcd.key("cas", "n")
    await etcd.put(key, b"0")
    real_get = etcd.get
    races = 1  # reads another writer follows at once

    async def get(k: bytes, *, deadline_s: float | None = None) -> KeyValue | None:
        nonlocal races
        kv = await real_get(k, deadline_s=deadline_s)
        if races > 0:
            races -= 1
            await etcd.put(k, b"10")
        return kv

    monkeypatch.setattr(etcd, "get", get)
    seen: list[bytes] = []

    def bump(kv: KeyValue | None) -> bytes:
        assert kv is not None
        seen.append(kv.value)
        return str(int(kv.value) + 1).encode()

    assert await cas(etcd, key, bump, "n") == b"11"
    assert seen == [b"0", b"10"]
    assert await cas(etcd, key, lambda kv: None, "n") is None
    races = 1_000
    with pytest.raises(CasConflict, match="3 writes lost"):
        await cas(etcd, key, bump, "n", attempts=3)
    with pytest.raises(CasConflict, match="within"):
        await cas(etcd, key, bump, "n", deadline_s=0.0)
    monkeypatch.undo()
    kv = await etcd.get(key)
    assert kv is not None and kv.value == b"10"
