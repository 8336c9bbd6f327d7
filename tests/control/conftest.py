"""The control plane's store under test, once per implementation: `SqliteStore` on a temp file
and `EtcdStore` on a real 3-member etcd (tests/cluster/etcd_cluster.py, one per test package
run, started only when an etcd case runs; each test gets its own key prefix)."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest
from cluster.etcd_cluster import EtcdCluster

from agentenv.cluster.etcd import Etcd
from agentenv.control.etcd_store import EtcdStore
from agentenv.control.sqlite_store import SqliteStore
from agentenv.control.store import Store

# Opens another store on the same state: a reopened SQLite file, or another replica on etcd.
OpenStore = Callable[[], Store]


@pytest.fixture(scope="package")
def etcd_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdCluster]:
    with EtcdCluster(tmp_path_factory.mktemp("etcd")) as cluster:
        yield cluster


@pytest.fixture(params=["sqlite", "etcd"])
async def open_store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[OpenStore]:
    opened: list[Store] = []
    if request.param == "sqlite":
        path = tmp_path / "agentenv.db"

        def new() -> Store:
            store = SqliteStore(path)
            opened.append(store)
            return store

    else:
        cluster: EtcdCluster = request.getfixturevalue("etcd_cluster")
        # A test that broke the cluster (killed its leader) must not break the next one.
        cluster.ensure_running()
        prefix = f"/agentenv-test-{uuid.uuid4().hex[:10]}/"

        def new() -> Store:
            store = EtcdStore(Etcd(cluster.endpoints, prefix=prefix))
            opened.append(store)
            return store

    try:
        yield new
    finally:
        for store in opened:
            await store.close()


@pytest.fixture
async def store(open_store: OpenStore) -> Store:
    return open_store()
