"""Snapshots pushed to SeaweedFS from one data dir and pulled into others (no VM needed:
real qcow2 layer chains, a sparse memory file and a state file)."""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import shutil
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import boto3
import pytest
from objstore.seaweed import SeaweedFS

from agentenv.objstore import BlobDigestMismatch, ObjectStore
from agentenv.objstore.bucket import (
    BLOB_PREFIX,
    MARK_PREFIX,
    MIN_PART_SIZE,
    REFS_PREFIX,
    blob_key,
)
from agentenv.snapshot import Snapshot, SnapshotNotFound, SnapshotRepository
from agentenv.snapshot.digest import sparse_digest
from agentenv.snapshot.remote import RemoteSnapshots
from agentenv.snapshot.remote_cache import CACHE_HOLDER
from agentenv.snapshot.remote_manifest import RemoteSnapshotError, _paused_blobs, manifest_key
from agentenv.storage import LayerStore, info

MIB = 1024 * 1024


@pytest.fixture(scope="module")
def seaweed() -> Iterator[SeaweedFS]:
    with SeaweedFS() as sw:
        yield sw


@pytest.fixture
async def store(seaweed: SeaweedFS, tmp_path: Path) -> AsyncIterator[ObjectStore]:
    async with ObjectStore(
        seaweed.config("snap-" + secrets.token_hex(5)),
        state_dir=tmp_path / "push-state",
        part_size=MIN_PART_SIZE,
        call_timeout_s=30.0,
    ) as s:
        await s.ensure_bucket()
        yield s


def _raw(store: ObjectStore):  # type: ignore[no-untyped-def]
    """A plain S3 client on the same bucket (to corrupt objects behind the store's back)."""
    return boto3.session.Session().client(
        "s3",
        endpoint_url=store.config.endpoint,
        aws_access_key_id=store.config.access_key,
        aws_secret_access_key=store.config.secret_key,
        region_name="us-east-1",
    )


def node(root: Path, store: ObjectStore) -> RemoteSnapshots:
    """One data dir's repository and layer store, and its remote side."""
    layers = LayerStore(root / "layers")
    repo = SnapshotRepository(root / "snapshots", layers)
    return RemoteSnapshots(store, repo, layers, state_dir=root / "blobs")


def qemu_io(image: Path, *cmds: str) -> None:
    args = ["qemu-io", "-f", "qcow2"]
    for c in cmds:
        args += ["-c", c]
    subprocess.run([*args, str(image)], check=True, capture_output=True)


def capture_fake(a: RemoteSnapshots, tmp: Path, tools: Path) -> Snapshot:
    """A two-layer chain (a base and an overlay with its own writes), 7 MiB of data in a
    128 MiB memory file, a device state: what a capture leaves in a repository."""
    base_img = tmp / "base.qcow2"
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", str(base_img), "32M"], check=True)
    qemu_io(base_img, "write -P 0x11 0 6M", "write -P 0x22 20M 1M")
    base = a.layers.add(base_img)
    over_img = tmp / "over.qcow2"
    subprocess.run(
        [
            "qemu-img", "create", "-q", "-f", "qcow2", "-F", "qcow2",
            "-b", str(a.layers.path(base)), str(over_img),
        ],
        check=True,
    )  # fmt: skip
    qemu_io(over_img, "write -P 0x33 1M 2M")
    top = a.layers.add(over_img)
    staging = a.repo.stage()
    with (staging / "memory").open("wb") as fh:
        fh.truncate(128 * MIB)
        for at in (0, 40 * MIB, 127 * MIB):
            fh.seek(at)
            fh.write(os.urandom(MIB) + b"\0" * 4096 + os.urandom(1024 * 1024))
    (staging / "state").write_bytes(os.urandom(70_000))
    draft = Snapshot(
        id="",
        layers=[base, top],
        vcpus=1,
        memory_mb=128,
        balloon=True,
        tools_image=str(tools),
        accel="tcg",
        qemu_version="7.2.0",
        envd_version="0.6.4",
        memory_bytes=0,
        state_bytes=0,
        names=["base.1c.128m"],
        envd_token="tok",
    )
    return a.repo.commit(staging, draft)


@pytest.fixture
def tools(tmp_path: Path) -> Path:
    path = tmp_path / "cache" / "tools-abc" / "tools.ext4"
    path.parent.mkdir(parents=True)
    path.write_bytes(os.urandom(300_000))
    # A build-cache artifact (`template.cache`): its inputs and build record beside it.
    (path.parent / "inputs.json").write_text('{"envd": "x"}')
    (path.parent / "build.json").write_text('{"built_at": 1}')
    return path


async def test_push_then_pull_into_another_data_dir(
    store: ObjectStore, tmp_path: Path, tools: Path
) -> None:
    a = node(tmp_path / "node-a", store)
    snap = capture_fake(a, tmp_path, tools)
    manifest = await a.push("base.1c.128m")
    assert manifest.snapshot.id == snap.id
    assert await a.exists(snap.id)
    assert await a.remote_ids() == [snap.id]
    sent = store.stats.bytes_uploaded
    # The memory file's holes do not travel.
    assert manifest.memory is not None and manifest.memory["size"] < 8 * MIB
    assert sent < 20 * MIB  # layers ~9, memory ~6 (of a 128 MiB file), tools
    # A second push sends nothing but the manifest.
    await a.push(snap.id)
    assert store.stats.bytes_uploaded == sent

    # Node B: another data dir, at a path of another length (its layers get rebased).
    b = node(tmp_path / "second-node-b", store)
    with pytest.raises(SnapshotNotFound):
        b.repo.get(snap.id)
    pulled = await b.pull(snap.id, names=["base.1c.128m"])
    assert pulled.id == snap.id and pulled.names == ["base.1c.128m"]
    assert CACHE_HOLDER in pulled.holders
    assert pulled.layers == snap.layers and pulled.envd_token == "tok"
    assert sparse_digest(b.repo.memory_path(snap.id)) == sparse_digest(a.repo.memory_path(snap.id))
    assert b.repo.memory_path(snap.id).stat().st_blocks <= 8 * MIB // 512
    assert b.repo.state_path(snap.id).read_bytes() == a.repo.state_path(snap.id).read_bytes()
    top_b = b.layers.path(snap.top_layer)
    assert info(top_b).backing_file == b.layers.path(snap.layers[0])
    assert oct(top_b.stat().st_mode & 0o777) == "0o444"
    # Same guest-visible disk as on A.
    compare = ["qemu-img", "compare", "-q", str(a.layers.path(snap.top_layer)), str(top_b)]
    await asyncio.to_thread(subprocess.run, compare, check=True)
    # Pulling again (or what is present) does no work.
    downloads = store.stats.downloads
    again = await b.pull(snap.id, holders=["sandbox-1"])
    assert store.stats.downloads == downloads and "sandbox-1" in again.holders
    assert not list((b.layers.root).glob(".pull-*"))
    assert not list(b.repo.root.glob(".staging-*"))


async def test_concurrent_pulls_fetch_once(store: ObjectStore, tmp_path: Path, tools: Path) -> None:
    a = node(tmp_path / "a", store)
    snap = capture_fake(a, tmp_path, tools)
    await a.push(snap.id)
    c = node(tmp_path / "c", store)
    results = await asyncio.gather(*(c.pull(snap.id) for _ in range(4)))
    assert {r.id for r in results} == {snap.id}
    # Two layers, memory and state; the tools layer is already there.
    assert store.stats.downloads == 4


async def test_tools_layer_is_fetched_when_missing(
    store: ObjectStore, tmp_path: Path, tools: Path
) -> None:
    a = node(tmp_path / "a", store)
    snap = capture_fake(a, tmp_path, tools)
    await a.push(snap.id)
    content = await asyncio.to_thread(tools.read_bytes)
    await asyncio.to_thread(shutil.rmtree, tools.parent)
    e = node(tmp_path / "e", store)
    await e.pull(snap.id)
    # The whole artifact directory is back, as the cache builds one: complete or absent.
    assert await asyncio.to_thread(tools.read_bytes) == content
    assert sorted(p.name for p in tools.parent.iterdir()) == [
        "build.json", "inputs.json", "tools.ext4",
    ]  # fmt: skip
    assert not list(tools.parent.parent.glob(".tmp-*"))


async def test_corrupt_blob_leaves_nothing_visible(
    store: ObjectStore, tmp_path: Path, tools: Path
) -> None:
    a = node(tmp_path / "a", store)
    snap = capture_fake(a, tmp_path, tools)
    manifest = await a.push(snap.id)
    assert manifest.state is not None
    await asyncio.to_thread(
        _raw(store).put_object,
        Bucket=store.bucket,
        Key=blob_key(manifest.state["blob"]),
        Body=os.urandom(manifest.state["size"]),
    )
    d = node(tmp_path / "d", store)
    with pytest.raises(BlobDigestMismatch):
        await d.pull(snap.id)
    assert d.repo.list() == []
    assert not list(d.repo.root.glob(".staging-*"))
    assert not [p for p in d.layers.root.iterdir() if p.name.startswith(".pull-")]
    # The layers it did fetch are unreferenced: the store's gc takes them.
    assert sorted(d.layers.gc()) == sorted(snap.layers)
    # Unknown snapshot: a clear error naming the bucket.
    with pytest.raises(SnapshotNotFound, match=store.bucket):
        await d.pull("f" * 32)
    assert await store.size_of(manifest_key(snap.id)) is not None


async def test_evict_keeps_used_snapshots(store: ObjectStore, tmp_path: Path, tools: Path) -> None:
    a = node(tmp_path / "a", store)
    snap = capture_fake(a, tmp_path, tools)
    await a.push(snap.id)
    b = node(tmp_path / "b", store)
    await b.pull(snap.id, holders=["sandbox-1"])
    assert b.evict(0) == []  # a sandbox holds it
    # The base layer's bytes never changed (no backing file): its blob is its digest.
    assert snap.layers[0] in b.pinned_blobs()
    b.repo.unref(snap.id, "sandbox-1")
    assert b.pinned_blobs() == set()
    assert b.evict(0) == [snap.id]
    with pytest.raises(SnapshotNotFound):
        b.repo.get(snap.id)
    assert b.layers.digests() == []
    # Evicted is not lost: the next use fetches it again.
    assert (await b.pull(snap.id)).id == snap.id


def pause_fake(a: RemoteSnapshots, snap: Snapshot, workdir: Path) -> None:
    """A paused sandbox's workdir as `snapshot.pause` leaves it (kind "state")."""
    workdir.mkdir(parents=True)
    upper = workdir / "rootfs.qcow2"
    subprocess.run(
        [
            "qemu-img", "create", "-q", "-f", "qcow2", "-F", "qcow2",
            "-b", str(a.layers.path(snap.top_layer)), str(upper),
        ],
        check=True,
    )  # fmt: skip
    qemu_io(upper, "write -P 0x44 4M 1M")
    a.layers.ref(snap.top_layer, "isbx1")
    record = {
        "name": "isbx1", "vcpus": 1, "memory_mb": 128, "balloon": True,
        "tools_image": snap.tools_image, "accel": "tcg", "qemu_version": "7.2.0",
        "kind": "state", "upper": "rootfs.qcow2", "paused_at": 1.0, "device_set": "1",
    }  # fmt: skip
    (workdir / "paused.json").write_text(json.dumps(record))
    (workdir / "sandbox.json").write_text(json.dumps({"top_layer": snap.top_layer}))
    with (workdir / "memory").open("wb") as fh:
        fh.truncate(128 * MIB)
        fh.seek(64 * MIB)
        fh.write(os.urandom(2 * MIB))
    (workdir / "state").write_bytes(os.urandom(50_000))
    (workdir / "console.log").write_text("not part of the pause")


async def test_paused_sandbox_moves_to_another_node(
    store: ObjectStore, tmp_path: Path, tools: Path
) -> None:
    a = node(tmp_path / "a", store)
    snap = capture_fake(a, tmp_path, tools)
    src = tmp_path / "a" / "sandboxes" / "isbx1"
    await asyncio.to_thread(pause_fake, a, snap, src)
    manifest = await a.push_paused(src, "isbx1")
    assert set(manifest["files"]) == {
        "paused.json", "sandbox.json", "rootfs.qcow2", "memory", "state",
    }  # fmt: skip
    b = node(tmp_path / "node-b-elsewhere", store)
    dest = tmp_path / "node-b-elsewhere" / "sandboxes" / "isbx1"
    await b.pull_paused("isbx1", dest)
    for name in ("paused.json", "sandbox.json", "state"):
        assert (dest / name).read_bytes() == (src / name).read_bytes()
    assert sparse_digest(dest / "memory") == sparse_digest(src / "memory")
    assert not (dest / "console.log").exists()
    assert info(dest / "rootfs.qcow2").backing_file == b.layers.path(snap.top_layer)
    compare = ["qemu-img", "compare", "-q", str(src / "rootfs.qcow2"), str(dest / "rootfs.qcow2")]
    await asyncio.to_thread(subprocess.run, compare, check=True)
    assert "isbx1" in b.layers.holders(snap.top_layer)
    assert not list((b.state_dir / "pulls").iterdir())
    with pytest.raises(RemoteSnapshotError, match="exists already"):
        await b.pull_paused("isbx1", dest)
    await a.delete_paused("isbx1")
    with pytest.raises(RemoteSnapshotError, match="not in"):
        await b.pull_paused("isbx1", tmp_path / "other")


async def test_a_node_finds_a_sandbox_paused_only_in_the_bucket(
    store: ObjectStore, tmp_path: Path, tools: Path
) -> None:
    """A node whose disk lacks a paused sandbox that the bucket has holds it (paused: a resume
    fetches it), so the control plane's reconciliation does not take it for lost."""
    from dataclasses import replace

    from agentenv.config import Settings
    from agentenv.node.runtime import NodeRuntime

    a = node(tmp_path / "a", store)
    snap = capture_fake(a, tmp_path, tools)
    await asyncio.to_thread(pause_fake, a, snap, tmp_path / "a" / "sandboxes" / "isbx1")
    assert await a.paused_kind("isbx1") is None
    await a.push_paused(tmp_path / "a" / "sandboxes" / "isbx1", "isbx1")
    assert await a.paused_kind("isbx1") == "state"
    elsewhere = NodeRuntime(replace(Settings.from_env(), home=tmp_path / "fresh-node"))
    assert await elsewhere.find("isbx1") is None  # no bucket: nothing to say
    elsewhere.remote = node(tmp_path / "fresh-node", store)
    found = await elsewhere.find("isbx1")
    assert found is not None and (found.state, found.placement, found.memory) == (
        "paused", None, True,
    )  # fmt: skip
    assert await elsewhere.find("other") is None
    await a.delete_paused("isbx1")
    assert await elsewhere.find("isbx1") is None


async def test_failed_paused_pull_leaves_no_workdir(
    store: ObjectStore, tmp_path: Path, tools: Path
) -> None:
    a = node(tmp_path / "a", store)
    snap = capture_fake(a, tmp_path, tools)
    src = tmp_path / "a" / "sandboxes" / "isbx1"
    await asyncio.to_thread(pause_fake, a, snap, src)
    manifest = await a.push_paused(src, "isbx1")
    mem = manifest["files"]["memory"]
    await asyncio.to_thread(
        _raw(store).put_object,
        Bucket=store.bucket,
        Key=blob_key(mem["blob"]),
        Body=os.urandom(mem["size"]),
    )
    b = node(tmp_path / "b", store)
    dest = tmp_path / "b" / "sandboxes" / "isbx1"
    with pytest.raises(BlobDigestMismatch):
        await b.pull_paused("isbx1", dest)
    assert not dest.exists()
    assert "isbx1" not in b.layers.holders(snap.top_layer)
    assert not list((b.state_dir / "pulls").iterdir())


PULL_CHILD = textwrap.dedent(
    """
    import asyncio, sys, time
    from pathlib import Path
    from agentenv.config import ObjectStoreConfig
    from agentenv.objstore import ObjectStore
    from agentenv.objstore.source import FileSink
    from agentenv.snapshot import SnapshotRepository
    from agentenv.snapshot.remote import RemoteSnapshots
    from agentenv.storage import LayerStore

    endpoint, bucket, ak, sk, root, snap_id = sys.argv[1:7]
    commits = 0
    real_commit, real_write = FileSink.commit, FileSink.write

    def commit(self):
        global commits
        real_commit(self)
        commits += 1

    def write(self, data):
        real_write(self, data)
        if commits >= 1:  # the first layer is in; the second blob is half written
            print("mid", flush=True)
            time.sleep(60)

    FileSink.commit, FileSink.write = commit, write

    async def main():
        store = ObjectStore(ObjectStoreConfig(endpoint, bucket, ak, sk), state_dir=Path(root) / "s")
        layers = LayerStore(Path(root) / "layers")
        remote = RemoteSnapshots(
            store, SnapshotRepository(Path(root) / "snapshots", layers), layers,
            state_dir=Path(root) / "blobs",
        )
        await remote.pull(snap_id)

    asyncio.run(main())
    """
)


async def test_pull_killed_midway_leaves_only_partials(
    store: ObjectStore, tmp_path: Path, tools: Path
) -> None:
    a = node(tmp_path / "a", store)
    snap = capture_fake(a, tmp_path, tools)
    await a.push(snap.id)
    root = tmp_path / "b"
    cfg = store.config
    argv = [cfg.endpoint, cfg.bucket, str(cfg.access_key), str(cfg.secret_key), str(root)]
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-c", PULL_CHILD, *argv, snap.id, stdout=asyncio.subprocess.PIPE
    )
    assert child.stdout is not None
    try:
        line = await asyncio.wait_for(child.stdout.readline(), timeout=60)
        assert line.strip() == b"mid"
    finally:
        child.kill()
        await child.wait()
    b = node(root, store)
    with pytest.raises(SnapshotNotFound):
        b.repo.get(snap.id)
    assert b.layers.digests() == [snap.layers[0]]  # only whole layers ever appear
    leftovers = await asyncio.to_thread(b.cleanup_partials)
    assert leftovers and all(".partial" in p.name or p.name.endswith(".tmp") for p in leftovers)
    # The next pull completes and fetches only what the first one had not finished.
    pulled = await b.pull(snap.id)
    assert pulled.id == snap.id
    assert store.stats.downloads == 3  # top layer, memory, state (the base was in)
    assert not [p for p in b.layers.root.iterdir() if p.name.startswith(".pull-")]


async def test_evict_removes_least_recently_used_first(
    store: ObjectStore, tmp_path: Path, tools: Path
) -> None:
    a = node(tmp_path / "a", store)
    first = capture_fake(a, tmp_path, tools)
    second = capture_fake(a, tmp_path, tools)
    assert first.id != second.id and first.layers == second.layers
    for snap in (first, second):
        await a.push(snap.id)
    b = node(tmp_path / "b", store)
    await b.pull(first.id)
    await b.pull(second.id)
    os.utime(b._manifest_copy(first.id), (1000.0, 1000.0))
    os.utime(b._manifest_copy(second.id), (2000.0, 2000.0))
    b.touch(first.id)  # used just now: the second is the least recently used
    one = b.repo.get(first.id)
    assert b.evict(one.memory_bytes + one.state_bytes + MIB) == [second.id]
    assert b.repo.get(first.id).id == first.id
    assert b.evict(10**12) == []  # within the limit: nothing goes


async def test_pull_trims_the_cache_but_keeps_what_it_pulled(
    store: ObjectStore, tmp_path: Path, tools: Path
) -> None:
    a = node(tmp_path / "a", store)
    first = capture_fake(a, tmp_path, tools)
    second = capture_fake(a, tmp_path, tools)
    third = capture_fake(a, tmp_path, tools)
    for snap in (first, second, third):
        await a.push(snap.id)
    b = node(tmp_path / "b", store)
    b.cache_limit_bytes = 1  # smaller than any snapshot
    await b.pull(first.id, holders=["sandbox-1"])  # in use: stays
    await b.pull(second.id)
    assert {s.id for s in b.repo.list()} == {first.id, second.id}
    await b.pull(third.id)  # the unused, older second goes; the new one stays
    assert {s.id for s in b.repo.list()} == {first.id, third.id}


async def _blobs(store: ObjectStore) -> set[str]:
    return {k[len(BLOB_PREFIX) :] for k in await store.list_keys(BLOB_PREFIX)}


async def test_gc_deletes_only_blobs_nothing_names_and_nobody_touched_lately(
    store: ObjectStore, tmp_path: Path, tools: Path
) -> None:
    a = node(tmp_path / "a", store)
    snap = capture_fake(a, tmp_path, tools)
    manifest = await a.push(snap.id)
    src = tmp_path / "a" / "sandboxes" / "isbx1"
    await asyncio.to_thread(pause_fake, a, snap, src)
    paused = await a.push_paused(src, "isbx1")
    kept_file, orphan_file = tmp_path / "kept.tar", tmp_path / "orphan.bin"
    kept_file.write_bytes(os.urandom(4096))
    orphan_file.write_bytes(os.urandom(4096))
    kept = await store.put_file(kept_file)
    orphan = await store.put_file(orphan_file)
    await store.put_json(f"{REFS_PREFIX}build-files/h1.json", {"blobs": [kept]})
    everything = await _blobs(store)
    assert {orphan, kept} | manifest.blobs() <= everything
    # Everything was uploaded or marked just now: a grace of an hour spares it all.
    assert await a.gc_blobs(grace_s=3600) == []
    assert await a.gc_blobs(grace_s=0) == [orphan]
    # The snapshot goes: what only it named goes, what the paused sandbox shares stays.
    assert await a.delete(snap.id)
    only_snapshot = manifest.blobs() - _paused_blobs(paused)
    assert only_snapshot and sorted(await a.gc_blobs(grace_s=0)) == sorted(only_snapshot)
    b = node(tmp_path / "b", store)
    await b.pull_paused("isbx1", tmp_path / "b" / "sandboxes" / "isbx1")
    await a.delete_paused("isbx1")
    await a.gc_blobs(grace_s=0)
    assert await _blobs(store) == {kept}
    assert [k for k in await store.list_keys(MARK_PREFIX)] == [MARK_PREFIX + kept]


async def test_a_push_whose_blob_a_collection_took_is_done_again(
    store: ObjectStore, tmp_path: Path, tools: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    a = node(tmp_path / "a", store)
    snap = capture_fake(a, tmp_path, tools)
    first = await a.push(snap.id)
    victim = sorted(first.blobs())[0]
    real_put_json = store.put_json
    taken: list[str] = []

    async def collected_meanwhile(key: str, doc: object) -> None:
        # A collection that listed before this manifest existed deletes a blob it reused.
        if key == manifest_key(snap.id) and not taken:
            await store.delete(blob_key(victim))
            taken.append(victim)
        await real_put_json(key, doc)

    monkeypatch.setattr(store, "put_json", collected_meanwhile)
    await a.delete(snap.id)
    again = await a.push(snap.id)
    assert taken == [victim] and victim in again.blobs()
    assert await store.has_blob(victim) is not None
    b = node(tmp_path / "b", store)
    assert (await b.pull(snap.id)).id == snap.id
