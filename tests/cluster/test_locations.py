"""Where templates and snapshots have local copies; the entries live on the holder's lease."""

from __future__ import annotations

import pytest

from agentenv.cluster.etcd import Etcd
from agentenv.cluster.locations import Locations

from .helpers import registered, wait_until

# grpc.aio delivers completions to the loop a call started on; one loop for every test here
# (see conftest.py).
pytestmark = pytest.mark.asyncio(loop_scope="session")


async def test_add_remove_holders(etcd: Etcd) -> None:
    a = await registered(etcd, "node-a")
    b = await registered(etcd, "node-b")
    try:
        at_a, at_b, reader = Locations(etcd, a), Locations(etcd, b), Locations(etcd)
        await at_a.add("template", "base")
        await at_b.add("template", "base")
        await at_b.add("snapshot", "snap-1")
        assert await reader.holders("template", "base") == ["node-a", "node-b"]
        assert await reader.holders("snapshot", "snap-1") == ["node-b"]
        assert await reader.holders("template", "other") == []
        await at_a.remove("template", "base")
        assert await reader.holders("template", "base") == ["node-b"]
        with pytest.raises(RuntimeError):
            await reader.add("template", "base")
        with pytest.raises(ValueError):
            await at_a.add("kernel", "x")
        with pytest.raises(ValueError):
            await at_a.add("template", "a/b")
    finally:
        await a.stop()
        await b.stop()


async def test_locations_vanish_with_the_holders_lease(etcd: Etcd) -> None:
    a = await registered(etcd, "node-a", ttl_s=2)
    b = await registered(etcd, "node-b", ttl_s=2)
    reader = Locations(etcd)
    try:
        await Locations(etcd, a).add("snapshot", "snap-1")
        await Locations(etcd, b).add("snapshot", "snap-1")
        await a.stop(deregister=False)  # dies without a word: only the lease ends it

        async def only_b() -> bool:
            return await reader.holders("snapshot", "snap-1") == ["node-b"]

        await wait_until(only_b, timeout_s=2 + 2.0)
    finally:
        await a.stop()
        await b.stop()
    assert await reader.holders("snapshot", "snap-1") == []
