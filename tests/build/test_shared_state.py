"""`EtcdBuildState`: two replicas' views of one cluster's builds (a real 3-member etcd and a
real SeaweedFS). What one replica writes the other reads; concurrent changes to one template
lose nothing; of concurrent starts of one build exactly one wins; logs arrive whole and in
order; an archive uploaded through one replica is fetched by the other."""

from __future__ import annotations

import asyncio
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import pytest_asyncio
from cluster.conftest import etcd, etcd_cluster, prefix  # noqa: F401 (fixtures)
from cluster.etcd_cluster import EtcdCluster
from objstore.seaweed import SeaweedFS

from agentenv.build.shared_state import MAX_LINE_CHARS, EtcdBuildState
from agentenv.build.state import BuildRecord, TemplateRecord
from agentenv.cluster.etcd import Etcd
from agentenv.objstore import ObjectStore

pytestmark = pytest.mark.asyncio(loop_scope="session")


@pytest.fixture(scope="module")
def seaweed() -> Iterator[SeaweedFS]:
    with SeaweedFS() as sw:
        yield sw


@pytest_asyncio.fixture(loop_scope="session")
async def replicas(
    etcd_cluster: EtcdCluster,  # noqa: F811
    prefix: str,  # noqa: F811
    seaweed: SeaweedFS,
    tmp_path: Path,
) -> AsyncIterator[tuple[EtcdBuildState, EtcdBuildState]]:
    etcd_cluster.ensure_running()
    bucket = "b-" + secrets.token_hex(6)
    made: list[tuple[Etcd, ObjectStore]] = []
    states = []
    for name in ("r1", "r2"):
        client = Etcd(etcd_cluster.endpoints, prefix=prefix)
        objects = ObjectStore(
            seaweed.config(bucket), state_dir=tmp_path / name / "blobs", call_timeout_s=30.0
        )
        made.append((client, objects))
        states.append(EtcdBuildState(client, objects, tmp_path / name))
    try:
        yield states[0], states[1]
    finally:
        for state in states:
            await state.close()
        for client, objects in made:
            await objects.close()
            await client.close()


def _template(name: str) -> TemplateRecord:
    now = time.time()
    return TemplateRecord(template_id=name, name=name, created_at=now, updated_at=now)


async def test_what_one_replica_writes_the_other_reads(
    replicas: tuple[EtcdBuildState, EtcdBuildState],
) -> None:
    a, b = replicas
    assert await b.template("app") is None
    await a.update_template("app", lambda _: _template("app"))
    got = await b.template("app")
    assert got is not None and got.name == "app"
    rec = BuildRecord(str(uuid.uuid4()), "app", "waiting", time.time(), tags=["default"])
    assert await a.put_build(rec)
    assert (await b.build(rec.build_id)) == rec
    assert [t.name for t in await b.templates()] == ["app"]
    assert [r.build_id for r in await b.builds()] == [rec.build_id]
    assert (await b.drop_template("app")) is not None
    assert await a.template("app") is None
    await b.drop_build(rec.build_id)
    assert await a.build(rec.build_id) is None


async def test_concurrent_changes_to_one_template_lose_nothing(
    replicas: tuple[EtcdBuildState, EtcdBuildState],
) -> None:
    a, b = replicas
    ids = [str(uuid.uuid4()) for _ in range(30)]

    def adder(build_id: str):  # type: ignore[no-untyped-def]
        def change(tpl: TemplateRecord | None) -> TemplateRecord:
            tpl = tpl or _template("busy")
            tpl.builds.append(build_id)
            return tpl

        return change

    await asyncio.gather(
        *((a if i % 2 else b).update_template("busy", adder(bid)) for i, bid in enumerate(ids))
    )
    got = await a.template("busy")
    assert got is not None and sorted(got.builds) == sorted(ids)
    # A change that returns None leaves the record as it is.
    assert await b.update_template("busy", lambda _: None) == got


async def test_of_concurrent_starts_of_one_build_exactly_one_wins(
    replicas: tuple[EtcdBuildState, EtcdBuildState],
) -> None:
    a, b = replicas
    rec = BuildRecord(str(uuid.uuid4()), "app", "waiting", time.time())
    await a.put_build(rec)
    claims = [replace(rec, status="building", runner=f"r{i}") for i in range(10)]
    won = await asyncio.gather(
        *((a if i % 2 else b).put_build(c, expect_status="waiting") for i, c in enumerate(claims))
    )
    assert sum(won) == 1
    stored = await b.build(rec.build_id)
    assert stored is not None and stored.runner == claims[won.index(True)].runner
    # A missing build is never "waiting".
    assert not await a.put_build(replace(rec, build_id="nope"), expect_status="waiting")


async def test_logs_arrive_whole_and_in_order(
    replicas: tuple[EtcdBuildState, EtcdBuildState],
) -> None:
    a, b = replicas
    bid = str(uuid.uuid4())
    for i in range(2000):
        a.log(bid, f"line {i}", step=str(i % 3))
    # A line far beyond a chunk's size is cut, not refused.
    a.log(bid, "x" * (MAX_LINE_CHARS * 4), "warn")
    # What is not written yet is not seen by the other replica, but is by this one.
    assert len(await a.logs(bid)) == 2001
    await a.flush_logs(bid)
    lines = await b.logs(bid)
    assert [ln.message for ln in lines[:2000]] == [f"line {i}" for i in range(2000)]
    assert lines[-1].level == "warn" and len(lines[-1].message) < MAX_LINE_CHARS + 100
    # Lines logged after a flush (and after some wait) come after the earlier ones.
    a.log(bid, "late")
    await asyncio.sleep(1.0)
    assert (await b.logs(bid))[-1].message == "late"
    await b.drop_build(bid)
    assert await a.logs(bid) == []


async def test_an_archive_uploaded_through_one_replica_is_fetched_by_the_other(
    replicas: tuple[EtcdBuildState, EtcdBuildState], tmp_path: Path
) -> None:
    a, b = replicas
    data = secrets.token_bytes(3 * 1024 * 1024)
    upload = a.staging() / ".upload"
    upload.write_bytes(data)
    assert not await b.has_files("h1")
    await a.put_files("h1", upload)
    assert not upload.exists()
    assert await b.has_files("h1")
    local = await b.files("h1")
    assert local is not None and local.read_bytes() == data
    assert await b.files("never") is None


async def test_the_builders_snapshot_names_are_shared(
    replicas: tuple[EtcdBuildState, EtcdBuildState],
) -> None:
    a, b = replicas
    sid = uuid.uuid4().hex
    assert await b.snapshot_named("build-final-x") is None
    await a.name_snapshot("build-final-x", sid)
    assert await b.snapshot_named("build-final-x") == sid
    assert await b.is_builder_snapshot(sid)
    assert not await b.is_builder_snapshot(uuid.uuid4().hex)
