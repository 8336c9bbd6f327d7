"""Control-plane replicas' leases (`cluster.replicas`): alive means the key exists."""

from __future__ import annotations

import asyncio
import json

import pytest

from agentenv.cluster.etcd import Etcd
from agentenv.cluster.replicas import ReplicaLease, live_replicas

from .helpers import wait_until

pytestmark = pytest.mark.asyncio(loop_scope="session")


async def test_a_replica_is_live_from_start_to_close(etcd: Etcd) -> None:
    a, b = ReplicaLease(etcd, ttl_s=2), ReplicaLease(etcd, ttl_s=2)
    assert a.replica_id != b.replica_id and len(a.replica_id) == 32
    assert await live_replicas(etcd) == set()
    await a.start()
    await b.start()
    try:
        assert await live_replicas(etcd) == {a.replica_id, b.replica_id}
        kv = await etcd.get(etcd.key("replicas", a.replica_id))
        assert kv is not None and kv.lease == a.lease_id
        assert json.loads(kv.value)["replica_id"] == a.replica_id
        # Beats keep it: well past the TTL it is still there.
        await asyncio.sleep(a.ttl_s * 1.5)
        assert await b.live() == {a.replica_id, b.replica_id}
        # A clean close revokes the lease: gone at once, not a TTL later.
        await b.close()
        assert await live_replicas(etcd) == {a.replica_id}
    finally:
        await a.close()
        await b.close()
    assert await live_replicas(etcd) == set()


async def test_a_replica_that_stops_beating_is_gone_after_its_ttl(etcd: Etcd) -> None:
    dead = ReplicaLease(etcd, ttl_s=2)
    await dead.start()
    # What SIGKILL does to a replica: no more beats, no revoke.
    await dead.stop(deregister=False)
    assert dead.replica_id in await live_replicas(etcd)
    waited = await wait_until(
        lambda: _absent(etcd, dead.replica_id), timeout_s=dead.ttl_s + 4, interval_s=0.2
    )
    assert waited <= dead.ttl_s + 3


async def _absent(etcd: Etcd, replica_id: str) -> bool:
    return replica_id not in await live_replicas(etcd)
