"""`cluster.runtime.ClusterRuntime` on a real etcd and real node RPC servers, each in front of
an in-memory runtime (tests/noderpc/memruntime.py): placement, cordons, refusals, routing by
binding, nodes that leave and come back, many creates at once. No VMs: the nodes' side is the
transport's test runtime, so what these check is the control plane's decisions."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import Any

import pytest
import pytest_asyncio
from noderpc.memruntime import MemoryRuntime

from agentenv.cluster.catalog import SharedCatalog, encode
from agentenv.cluster.etcd import Etcd
from agentenv.cluster.membership import Capacity, Load, NodeInfo, NodeRegistration
from agentenv.cluster.runtime import ClusterRuntime, NodeDown
from agentenv.config import Settings
from agentenv.contract.errors import Unavailable
from agentenv.contract.runtime import SandboxSpec, TemplateInfo
from agentenv.noderpc.server import NodeServer

from .etcd_cluster import EtcdCluster

# grpc.aio (aetcd) answers on the loop a call started on: one loop for the module's tests.
pytestmark = pytest.mark.asyncio(loop_scope="session")

TOKEN = secrets.token_urlsafe(16)
MEM = 512


@dataclass
class FakeNode:
    node_id: str
    runtime: MemoryRuntime
    server: NodeServer
    registration: NodeRegistration
    free_mb: int = 65536

    def load(self) -> Load:
        running = sum(1 for h in self.runtime.held.values() if h.state == "running")
        return Load(free_memory_mb=self.free_mb - running * MEM, running=running, free_slots=100)


async def _node(etcd: Etcd, node_id: str, free_mb: int = 65536) -> FakeNode:
    runtime = MemoryRuntime()
    server = NodeServer(runtime, "127.0.0.1", 0, TOKEN, heartbeat_s=0.2)
    await server.start()
    info = NodeInfo(
        node_id,
        server.url,
        "127.0.0.1",
        Capacity(2, 131072, 100),
        Load(free_mb, 0, 100),
        "t",
        gateway=f"gw-{node_id}:7101",
    )
    node = FakeNode(node_id, runtime, server, NodeRegistration(etcd, info, ttl_s=3), free_mb)
    node.registration.load_source = node.load
    await node.registration.start()
    return node


@pytest_asyncio.fixture(loop_scope="session")
async def nodes(etcd: Etcd) -> AsyncIterator[list[FakeNode]]:
    made = [await _node(etcd, f"n{i}") for i in range(3)]
    try:
        yield made
    finally:
        for n in made:
            await n.registration.stop()
            await n.server.stop()


@pytest_asyncio.fixture(loop_scope="session")
async def cluster(
    etcd_cluster: EtcdCluster, prefix: str, nodes: list[FakeNode]
) -> AsyncIterator[ClusterRuntime]:
    settings = replace(
        Settings.from_env(),
        etcd_endpoints=tuple(etcd_cluster.endpoints.split(",")),
        etcd_prefix=prefix,
        node_token=TOKEN,
    )
    rt = ClusterRuntime(settings)
    await rt.start()
    # Each node, once seen joining, is asked what it holds (orphans go): let that pass first.
    for _ in range(100):
        if all(any(c[0] == "sandbox_ids" for c in n.runtime.calls) for n in nodes):
            break
        await asyncio.sleep(0.05)
    try:
        yield rt
    finally:
        await rt.close()


def spec(i: int | str, template: str = "base") -> SandboxSpec:
    return SandboxSpec(f"sb-{i}", template, 1, MEM, envd_token=f"tok-{i}")


def where(nodes: list[FakeNode]) -> dict[str, str]:
    return {rid: n.node_id for n in nodes for rid in n.runtime.held}


async def test_creates_spread_over_the_nodes_and_each_lands_once(
    cluster: ClusterRuntime, nodes: list[FakeNode]
) -> None:
    placed = [await cluster.create(spec(i)) for i in range(12)]
    assert [p.sandbox_id for p in placed] == [f"sb-{i}" for i in range(12)]
    at = where(nodes)
    assert sorted(at) == sorted(p.sandbox_id for p in placed)
    # Sampled best of K: no node gets them all, every node gets some of twelve.
    assert len(set(at.values())) == 3, at
    assert await cluster.bindings.all() == at
    # The whole spec reached the node (token, shape), once.
    held = nodes[0].runtime.held[next(r for r, n in at.items() if n == "n0")]
    assert held.spec.envd_token and held.spec.memory_mb == MEM


async def test_many_concurrent_creates_all_land_and_are_bound(
    cluster: ClusterRuntime, nodes: list[FakeNode]
) -> None:
    placed = await asyncio.gather(*(cluster.create(spec(f"c{i}")) for i in range(40)))
    at = where(nodes)
    assert len(placed) == len(at) == 40
    assert await cluster.bindings.all() == at
    # Concurrent creates see the same published load; the sample and in-flight count spread them
    # (no node left out). How evenly also depends on when each node publishes a load that
    # counts what it was just given: on a loaded host (two test workers on two cores) one node
    # got 3 of the 40, so the bound is what herding would break, not an even share.
    assert min(list(at.values()).count(n.node_id) for n in nodes) >= 2, at


async def test_cordoned_nodes_get_nothing_new(
    cluster: ClusterRuntime, nodes: list[FakeNode]
) -> None:
    await cluster.cordon("n0", cordoned=True, reason="maintenance")
    await cluster.cordon("n1", cordoned=True)
    for i in range(5):
        await cluster.create(spec(i))
    assert set(where(nodes).values()) == {"n2"}
    listed = {s.node_id: s for s in await cluster.nodes()}
    assert listed["n0"].state == "cordoned" and listed["n0"].cordon_reason == "maintenance"
    assert listed["n2"].state == "ready"
    await cluster.cordon("n2", cordoned=True)
    with pytest.raises(Unavailable, match="no ready node"):
        await cluster.create(spec("none"))


async def test_a_refusing_node_is_skipped_and_keeps_no_binding(
    cluster: ClusterRuntime, nodes: list[FakeNode]
) -> None:
    for n in nodes[:2]:
        n.runtime.fail = Unavailable(f"{n.node_id} is full", 7)
    await cluster.cordon("n2", cordoned=True)
    with pytest.raises(Unavailable, match="no node could take") as refused:
        await cluster.create(spec("x"))
    assert refused.value.retry_after == 7
    assert await cluster.bindings.all() == {}
    await cluster.cordon("n2", cordoned=False)
    nodes[0].runtime.fail = Unavailable("n0 is full", 7)
    nodes[1].runtime.fail = Unavailable("n1 is full", 7)
    # The next create finds room on the one node that does not refuse.
    placed = await cluster.create(spec("y"))
    assert where(nodes)[placed.sandbox_id] == "n2"
    assert await cluster.bindings.all() == {"sb-y": "n2"}


async def test_a_create_that_may_wait_queues_on_a_full_node_instead_of_a_503(
    cluster: ClusterRuntime, nodes: list[FakeNode]
) -> None:
    for n in nodes:
        n.free_mb = 0
    for _ in range(200):
        if all(n.load.free_memory_mb <= 0 for n in await cluster.membership.list_nodes()):
            break
        await asyncio.sleep(0.1)
    # No wait allowed: refused here, with what each node has free.
    with pytest.raises(Unavailable, match="no node can take a sandbox of 512 MB"):
        await cluster.create(replace(spec("now"), capacity_wait_s=0.0))
    assert await cluster.bindings.all() == {}
    # A wait allowed (its own, or the node's default): sent to one node, whose admission
    # queues it; the in-memory node takes it at once, with the wait in its spec.
    for i, wait in enumerate((30.0, None)):
        placed = await cluster.create(replace(spec(f"w{i}"), capacity_wait_s=wait))
        node = next(n for n in nodes if n.node_id == placed.node_id)
        assert node.runtime.held[placed.sandbox_id].spec.capacity_wait_s == wait


async def test_calls_go_to_the_bound_node_and_delete_unbinds(
    cluster: ClusterRuntime, nodes: list[FakeNode]
) -> None:
    await cluster.create(spec(1))
    home = where(nodes)["sb-1"]
    node = next(n for n in nodes if n.node_id == home)
    await cluster.pause("sb-1")
    assert node.runtime.held["sb-1"].state == "paused"
    found = await cluster.find("sb-1")
    assert found is not None and found.state == "paused"
    await cluster.resume(spec(1))
    assert node.runtime.held["sb-1"].state == "running"
    assert await cluster.is_alive("sb-1") and "sb-1" in await cluster.sandbox_ids()
    await cluster.delete("sb-1")
    assert "sb-1" not in node.runtime.held and await cluster.bindings.get("sb-1") is None
    assert await cluster.find("sb-1") is None


async def test_placements_name_their_node_and_its_gateway_is_known(
    cluster: ClusterRuntime, nodes: list[FakeNode]
) -> None:
    """The proxy reaches a sandbox through the data gateway of the node its placement
    names: create, find, resume and fork placements all name it."""
    placed = await cluster.create(spec("g"))
    home = where(nodes)["sb-g"]
    assert placed.node_id == home
    found = await cluster.find("sb-g")
    assert found is not None and found.placement is not None
    assert found.placement.node_id == home
    await cluster.pause("sb-g")
    assert (await cluster.resume(spec("g"))).node_id == home
    children = await cluster.fork("sb-g", [spec("g1"), spec("g2")], "tok-g")
    assert [c.node_id for c in children] == [home, home]
    assert await cluster.gateway(home) == f"gw-{home}:7101"
    # A node this replica has never seen is read from etcd once; an unknown one has none.
    cluster._gateways.clear()
    assert await cluster.gateway(home) == f"gw-{home}:7101"
    assert await cluster.gateway("no-such-node") is None
    # An old entry is read again (an agent back on another port before its rejoin).
    cluster._gateways[home] = ("gw-stale:1", 0.0)
    assert await cluster.gateway(home) == f"gw-{home}:7101"
    for rid in ("sb-g", "sb-g1", "sb-g2"):
        await cluster.delete(rid)


async def test_a_node_that_leaves_reports_its_running_sandboxes_lost(
    cluster: ClusterRuntime, nodes: list[FakeNode]
) -> None:
    lost: list[tuple[str, str]] = []
    cluster.watch_lost(lambda rid, why: lost.append((rid, why)))
    await cluster.cordon("n1", cordoned=True)
    await cluster.cordon("n2", cordoned=True)
    await cluster.create(spec(1))
    assert where(nodes)["sb-1"] == "n0"
    # The agent dies without a word: its lease lapses (TTL 3 s).
    await nodes[0].registration.stop(deregister=False)
    await nodes[0].server.stop()
    for _ in range(100):
        if lost:
            break
        await asyncio.sleep(0.1)
    assert lost and lost[0][0] == "sb-1" and "n0" in lost[0][1], lost
    assert not await cluster.is_alive("sb-1")
    with pytest.raises(NodeDown, match="n0"):
        await cluster.pause("sb-1")
    # A fork runs where its source is (running or paused): the error says what would help,
    # and no child is left bound.
    with pytest.raises(NodeDown, match=r"n0.*resume the sandbox"):
        await cluster.fork("sb-1", [spec("kid")], None)
    assert await cluster.bindings.get("sb-kid") is None
    # The binding stays until the control plane deletes the sandbox; that needs no node.
    await cluster.delete("sb-1")
    assert await cluster.bindings.get("sb-1") is None


async def test_a_returning_node_drops_what_nobody_is_bound_to(
    etcd: Etcd, cluster: ClusterRuntime, nodes: list[FakeNode]
) -> None:
    extra = await _node(etcd, "late")
    try:
        # Made there while it was away from this control plane, bound to nothing.
        await extra.runtime.create(spec("orphan"))
        await extra.registration.stop(deregister=True)
        await extra.registration.start()
        for _ in range(100):
            if "sb-orphan" not in extra.runtime.held:
                break
            await asyncio.sleep(0.1)
        assert "sb-orphan" not in extra.runtime.held
    finally:
        await extra.registration.stop()
        await extra.server.stop()


async def _lost_after(lost: list[tuple[str, str]], rid: str, within_s: float) -> str:
    for _ in range(int(within_s / 0.05)):
        for got, why in lost:
            if got == rid:
                return why
        await asyncio.sleep(0.05)
    raise AssertionError(f"{rid} not reported lost within {within_s} s: {lost}")


async def test_a_node_back_within_its_lease_reports_what_it_came_back_without(
    cluster: ClusterRuntime, nodes: list[FakeNode]
) -> None:
    lost: list[tuple[str, str]] = []
    cluster.watch_lost(lambda rid, why: lost.append((rid, why)))
    await cluster.cordon("n1", cordoned=True)
    await cluster.cordon("n2", cordoned=True)
    for i in (1, 2, 3):
        await cluster.create(spec(i))
    await cluster.pause("sb-2")
    assert set(where(nodes)) == {"sb-1", "sb-2", "sb-3"} and set(where(nodes).values()) == {"n0"}
    # The agent dies and comes back before its lease lapses (no leave): the VM of sb-1 died
    # meanwhile, which its recovery found (the lost event went to nobody).
    n0 = nodes[0]
    await n0.registration.stop(deregister=False)
    del n0.runtime.held["sb-1"]
    n0.runtime.lost["sb-1"] = "its VM was no longer running when the server restarted"
    await n0.registration.start()
    # Reported on its join, long before the periodic check (30 s).
    why = await _lost_after(lost, "sb-1", 5.0)
    assert "n0" in why and "no longer running" in why, why
    await asyncio.sleep(0.5)
    # The running one it re-adopted and the paused one it keeps are not lost.
    assert [rid for rid, _ in lost] == ["sb-1"], lost
    await cluster.reconcile()
    assert [rid for rid, _ in lost] == ["sb-1"], lost


async def test_reconciliation_spares_creates_in_flight_moves_and_waits_out_silence(
    cluster: ClusterRuntime, nodes: list[FakeNode], monkeypatch: pytest.MonkeyPatch
) -> None:
    lost: list[tuple[str, str]] = []
    cluster.watch_lost(lambda rid, why: lost.append((rid, why)))
    await cluster.cordon("n1", cordoned=True)
    await cluster.cordon("n2", cordoned=True)
    n0 = nodes[0]
    # A create in flight: bound to n0, not there yet (the node takes a minute).
    slow = asyncio.create_task(cluster.create(spec("slow", template="slow")))
    # One whose binding moves to n1 while n0 is being asked (a resume elsewhere).
    await cluster.create(spec("moving"))
    del n0.runtime.held["sb-moving"]
    n0.runtime.lost["sb-moving"] = "gone"
    real_lost_reason = n0.runtime.lost_reason

    async def moved_while_asked(sandbox_id: str) -> Any:
        if sandbox_id == "sb-moving":
            assert await cluster.bindings.move("sb-moving", "n0", "n1")
        return await real_lost_reason(sandbox_id)

    monkeypatch.setattr(n0.runtime, "lost_reason", moved_while_asked)
    # One the node lacks and says nothing about (its data dir was replaced, say).
    assert await cluster.bindings.create("sb-silent", "n0")
    try:
        for _ in range(100):
            if await cluster.bindings.get("sb-slow") == "n0":
                break
            await asyncio.sleep(0.05)
        await cluster.reconcile()
        # The create in flight and a young silent binding are within the grace (the longest
        # call that binds first); the moved one is not n0's, whatever n0 says about it.
        assert lost == []
        await cluster.delete("sb-moving")
    finally:
        slow.cancel()
        await asyncio.gather(slow, return_exceptions=True)
    assert await cluster.bindings.get("sb-slow") is None
    cluster.lost_grace_s = 1.0
    await asyncio.sleep(1.2)
    await cluster.reconcile()
    # Missing, unchanged and unexplained for longer than the grace: lost, naming the node.
    assert [rid for rid, _ in lost] == ["sb-silent"], lost
    assert "n0" in lost[0][1] and "not there for" in lost[0][1], lost


async def test_one_slow_node_does_not_hold_up_the_others(
    cluster: ClusterRuntime, nodes: list[FakeNode], monkeypatch: pytest.MonkeyPatch
) -> None:
    lost: list[tuple[str, str]] = []
    cluster.watch_lost(lambda rid, why: lost.append((rid, why)))
    await cluster.cordon("n1", cordoned=True)
    await cluster.cordon("n2", cordoned=True)
    await cluster.create(spec("dead"))
    del nodes[0].runtime.held["sb-dead"]
    nodes[0].runtime.lost["sb-dead"] = "its VM ended"

    async def hang() -> list[str]:
        await asyncio.sleep(3600)
        return []

    monkeypatch.setattr(nodes[1].runtime, "sandbox_ids", hang)
    cluster.node_check_s = 1.0
    loop = asyncio.get_running_loop()
    started = loop.time()
    await cluster.reconcile()
    assert loop.time() - started < 3.0
    assert [rid for rid, _ in lost] == ["sb-dead"] and "n0" in lost[0][1], lost


async def test_a_catalog_template_is_placed_only_where_a_node_has_it(
    cluster: ClusterRuntime, nodes: list[FakeNode]
) -> None:
    catalog = SharedCatalog(cluster.etcd)
    info = TemplateInfo("py-image", 1024, 1.0, 1.0, 1, MEM, layers=("sha256:" + "c" * 64,))
    await catalog.publish(nodes[2].registration, {"py-image": encode(info)}, {})
    await asyncio.gather(*(cluster.create(spec(f"img-{i}", template="py-image")) for i in range(6)))
    assert {where(nodes)[f"sb-img-{i}"] for i in range(6)} == {"n2"}
    # A template no node publishes is not restricted (a snapshot id, or an older node).
    # Concurrent creates may all be placed before any counts as in flight, each on the
    # better of two sampled nodes (a tie, here, goes either way): if every pick is a coin
    # toss, 6 all land on one node 1 time in 32 (it happened once in a suite run), 12 one
    # time in 2048.
    await asyncio.gather(*(cluster.create(spec(f"free-{i}")) for i in range(12)))
    assert len({where(nodes)[f"sb-free-{i}"] for i in range(12)}) >= 2
    # Its only holder cordoned: no node can take it, and the answer says where it is.
    await cluster.cordon("n2", cordoned=True)
    with pytest.raises(Unavailable, match="n2"):
        await cluster.create(spec("img-x", template="py-image"))
    assert await cluster.bindings.get("sb-img-x") is None


async def test_a_snapshot_delete_leaves_a_tombstone_for_nodes_that_were_away(
    cluster: ClusterRuntime, nodes: list[FakeNode]
) -> None:
    snap_id = "ab" * 16
    assert not await cluster.tombstones.has(snap_id)
    assert await cluster.delete_snapshot(snap_id) is False  # no live node held it
    # Written before any node is asked: a node that missed the delete drops its copy later.
    assert await cluster.tombstones.has(snap_id)
    assert snap_id in await cluster.tombstones.all()
    assert all(("delete_snapshot", (snap_id,)) in n.runtime.calls for n in nodes)
    # A name that is not a snapshot id leaves none (the nodes refuse it themselves).
    await cluster.delete_snapshot("build-final-x")
    assert "build-final-x" not in await cluster.tombstones.all()


async def test_an_imported_image_is_removed_from_every_live_node(
    cluster: ClusterRuntime, nodes: list[FakeNode]
) -> None:
    nodes[1].runtime.images = {"image-abc"}
    assert await cluster.remove_image("image-abc") is True
    assert all(("remove_image", ("image-abc",)) in n.runtime.calls for n in nodes)
    assert await cluster.remove_image("image-abc") is False
