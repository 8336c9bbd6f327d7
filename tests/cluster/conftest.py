"""A 3-member etcd per test module (tests/cluster/etcd_cluster.py), and a fresh key prefix
per test so tests sharing the cluster never see each other's keys.

Every async test and fixture here runs on one session-wide event loop (each module sets
`pytestmark = pytest.mark.asyncio(loop_scope="session")`). grpc.aio, under aetcd, hands each
completion to the loop its call started on; with a new loop per test, completions of calls
from a closed loop (cancelled at their deadline, channels closing) raise "Event loop is
closed" inside grpc's dispatch. A process with one loop, like a node agent or a replica, never
meets this.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import pytest_asyncio

from agentenv.cluster.etcd import Etcd

from .etcd_cluster import EtcdCluster


@pytest.fixture(scope="module")
def etcd_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdCluster]:
    workdir: Path = tmp_path_factory.mktemp("etcd")
    with EtcdCluster(workdir) as cluster:
        yield cluster


@pytest.fixture
def prefix() -> str:
    return f"/agentenv-test-{uuid.uuid4().hex[:10]}/"


@pytest_asyncio.fixture(loop_scope="session")
async def etcd(etcd_cluster: EtcdCluster, prefix: str) -> AsyncIterator[Etcd]:
    # A test that broke the cluster must not break the next one.
    etcd_cluster.ensure_running()
    client = Etcd(etcd_cluster.endpoints, prefix=prefix)
    try:
        yield client
    finally:
        await client.close()
