"""Replicas sharing a store (etcd) take a team's creates from one rate bucket: two replicas
admit what one would, not twice as much."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio
from cluster.conftest import etcd_cluster, prefix  # noqa: F401 (fixtures)
from cluster.etcd_cluster import EtcdCluster

from agentenv.cluster.etcd import Etcd
from agentenv.contract.errors import TooManyRequests
from agentenv.control.etcd_store import EtcdStore
from agentenv.control.tenants import SharedBuckets, TeamLimits

pytestmark = pytest.mark.asyncio(loop_scope="session")


@pytest_asyncio.fixture(loop_scope="session")
async def stores(
    etcd_cluster: EtcdCluster,  # noqa: F811
    prefix: str,  # noqa: F811
) -> AsyncIterator[tuple[EtcdStore, EtcdStore]]:
    etcd_cluster.ensure_running()
    clients = [Etcd(etcd_cluster.endpoints, prefix=prefix) for _ in range(2)]
    try:
        yield EtcdStore(clients[0]), EtcdStore(clients[1])
    finally:
        for c in clients:
            await c.close()


async def test_two_replicas_share_one_bucket_per_team(stores: tuple[EtcdStore, EtcdStore]) -> None:
    a, b = stores
    assert isinstance(a, SharedBuckets)
    team = await a.add_team("t-rate", "rate")
    await a.set_team_limits(team.id, max_sandboxes=None, creates_per_minute=6)
    limits = [TeamLimits(a), TeamLimits(b)]
    outcomes = await asyncio.gather(
        *(limits[i % 2].admit(team.id) for i in range(10)), return_exceptions=True
    )
    refused = [o for o in outcomes if isinstance(o, TooManyRequests)]
    assert len(refused) == 4 and outcomes.count(None) == 6, outcomes
    assert all(1 <= r.retry_after <= 10 for r in refused)
    # Another team's bucket is its own; a resume (not a create) takes nothing.
    other = await b.add_team("t-other", "other")
    await b.set_team_limits(other.id, max_sandboxes=None, creates_per_minute=1)
    await limits[0].admit(other.id)
    with pytest.raises(TooManyRequests):
        await limits[1].admit(other.id)
    await limits[1].admit(other.id, create=False)
    # More at once than a minute's allowance is refused outright.
    with pytest.raises(TooManyRequests, match="more than"):
        await limits[0].admit(team.id, 7)
