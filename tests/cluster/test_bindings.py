"""Sandbox -> node bindings: create only if absent, move only from the node it is on,
persistent across the node's death; against a real 3-member etcd."""

from __future__ import annotations

import asyncio

import pytest

from agentenv.cluster.bindings import Bindings
from agentenv.cluster.etcd import Etcd
from agentenv.cluster.membership import Membership

from .helpers import registered, wait_until

# grpc.aio delivers completions to the loop a call started on; one loop for every test here
# (see conftest.py).
pytestmark = pytest.mark.asyncio(loop_scope="session")


async def test_concurrent_creates_exactly_one_wins(etcd: Etcd) -> None:
    bindings = Bindings(etcd)
    for round_ in range(20):
        sandbox = f"sb-{round_}"
        nodes = ["node-a", "node-b", "node-c"]
        results = await asyncio.gather(*(bindings.create(sandbox, node) for node in nodes))
        assert sum(results) == 1, results
        winner = nodes[results.index(True)]
        assert await bindings.get(sandbox) == winner
        # A second create for the winner is a no-op success; for anyone else a refusal.
        assert await bindings.create(sandbox, winner)
        assert not await bindings.create(sandbox, next(n for n in nodes if n != winner))
    assert len(await bindings.all()) == 20


async def test_move_only_from_the_node_it_is_on(etcd: Etcd) -> None:
    bindings = Bindings(etcd)
    assert await bindings.create("sb-1", "node-a")
    assert not await bindings.move("sb-1", "node-b", "node-c")  # not on node-b
    assert await bindings.get("sb-1") == "node-a"
    assert not await bindings.move("sb-missing", "node-a", "node-b")
    assert await bindings.move("sb-1", "node-a", "node-b")
    assert await bindings.get("sb-1") == "node-b"
    assert await bindings.of_node("node-a") == []
    assert await bindings.of_node("node-b") == ["sb-1"]
    # Two replicas moving the same sandbox off node-b at once: one wins.
    results = await asyncio.gather(
        bindings.move("sb-1", "node-b", "node-c"), bindings.move("sb-1", "node-b", "node-d")
    )
    assert sorted(results) == [False, True]
    now = await bindings.get("sb-1")
    assert now == ("node-c" if results[0] else "node-d")
    assert await bindings.of_node(now) == ["sb-1"] and await bindings.of_node("node-b") == []


async def test_delete(etcd: Etcd) -> None:
    bindings = Bindings(etcd)
    assert await bindings.create("sb-1", "node-a")
    assert await bindings.create("sb-2", "node-a")
    assert not await bindings.delete("sb-1", "node-b")  # guarded by the node it is on
    assert await bindings.delete("sb-1", "node-a")
    assert await bindings.delete("sb-2")
    assert not await bindings.delete("sb-2")
    assert await bindings.all() == {}
    assert await bindings.of_node("node-a") == []
    assert await bindings.get("sb-1") is None


async def test_bindings_outlive_their_node(etcd: Etcd) -> None:
    bindings = Bindings(etcd)
    members = Membership(etcd)
    a = await registered(etcd, "node-a", ttl_s=2)
    for i in range(3):
        assert await bindings.create(f"sb-{i}", "node-a")
    await a.stop(deregister=False)
    await wait_until(lambda: _gone(members, "node-a"), timeout_s=5)
    # The node is dead; the control plane still sees where its sandboxes were.
    assert await bindings.of_node("node-a") == ["sb-0", "sb-1", "sb-2"]
    assert await bindings.move("sb-1", "node-a", "node-b")
    assert await bindings.all() == {"sb-0": "node-a", "sb-1": "node-b", "sb-2": "node-a"}


async def _gone(members: Membership, node_id: str) -> bool:
    return await members.get_node(node_id) is None
