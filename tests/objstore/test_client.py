"""ObjectStore against a real SeaweedFS S3 gateway on loopback."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import boto3
import pytest

from agentenv.objstore import (
    BlobCache,
    BlobDigestMismatch,
    BlobNotFound,
    ObjectStore,
    ObjectStoreError,
    SparseSink,
    SparseSource,
    blob_key,
)
from agentenv.snapshot.digest import sparse_digest

from .conftest import PART
from .seaweed import SeaweedFS

MIB = 1024 * 1024


def _write(path: Path, size: int, seed: int = 0) -> str:
    """A file of pseudo-random bytes (fast: a repeated random block shifted by the seed)."""
    block = hashlib.sha256(str(seed).encode()).digest() * 2048  # 64 KiB
    rnd = os.urandom(4096)
    with path.open("wb") as fh:
        left, n = size, 0
        while left > 0:
            chunk = (rnd + n.to_bytes(8, "little") + block)[: min(left, len(block) + 4104)]
            fh.write(chunk)
            left -= len(chunk)
            n += 1
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _raw_client(store: ObjectStore):  # type: ignore[no-untyped-def]
    cfg = store.config
    return boto3.session.Session().client(
        "s3",
        endpoint_url=cfg.endpoint,
        aws_access_key_id=cfg.access_key,
        aws_secret_access_key=cfg.secret_key,
        region_name=cfg.region,
    )


async def test_small_put_get_roundtrip(store: ObjectStore, tmp_path: Path) -> None:
    src = tmp_path / "small"
    want = _write(src, 300_000)
    digest = await store.put_file(src)
    assert digest == want
    assert store.stats.single_puts == 1 and store.stats.multipart_started == 0
    assert await store.has_blob(digest) == 300_000
    dest = tmp_path / "out" / "copy"
    await store.get_file(digest, dest)
    assert dest.read_bytes() == src.read_bytes()
    assert not list(dest.parent.glob("*.partial"))


async def test_same_content_is_uploaded_once(store: ObjectStore, tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    _write(a, 2 * PART + 123)
    b.write_bytes(a.read_bytes())
    first = await store.put_file(a)
    again = await store.put_file(a)
    other_path = await store.put_file(b)
    assert first == again == other_path
    assert store.stats.puts_skipped == 2
    assert store.stats.bytes_uploaded == a.stat().st_size
    # `a` again is known by its identity (not even read); `b` had to be hashed.
    assert store.stats.hashes_skipped == 1
    # Eight at once of one file: one upload, seven skips.
    c = tmp_path / "c"
    _write(c, 400_000, seed=3)
    before = store.stats.single_puts
    digests = await asyncio.gather(*(store.put_file(c) for _ in range(8)))
    assert len(set(digests)) == 1
    assert store.stats.single_puts - before == 1
    assert store.stats.puts_skipped == 2 + 7


async def test_multipart_several_parts_and_speed(store: ObjectStore, tmp_path: Path) -> None:
    src = tmp_path / "big"
    size = 12 * PART + 777  # 13 parts, the last one short
    want = _write(src, size)
    t0 = time.monotonic()
    digest = await store.put_file(src)
    up_s = time.monotonic() - t0
    assert digest == want
    assert store.stats.multipart_started == 1
    assert store.stats.parts_uploaded == 13
    assert await store.has_blob(digest) == size
    # Nothing is left of the upload's local record once it completed.
    assert not list((store.state_dir / "uploads").glob("*.json"))
    dest = tmp_path / "copy"
    t0 = time.monotonic()
    await store.get_file(digest, dest)
    down_s = time.monotonic() - t0
    assert hashlib.sha256(dest.read_bytes()).hexdigest() == want
    mb = size / MIB
    print(
        f"\n{mb:.0f} MiB: upload {mb / up_s:.0f} MiB/s (hash included), "
        f"download {mb / down_s:.0f} MiB/s (verified)"
    )


CHILD = textwrap.dedent(
    """
    import asyncio, sys, time
    from pathlib import Path
    from agentenv.config import ObjectStoreConfig
    from agentenv.objstore import ObjectStore

    endpoint, bucket, ak, sk, state, src, part = sys.argv[1:8]

    async def main():
        cfg = ObjectStoreConfig(endpoint, bucket, ak, sk)
        store = ObjectStore(cfg, state_dir=Path(state), part_size=int(part), part_concurrency=1)
        real = store._client.upload_part
        def slow_part(**kw):
            answer = real(**kw)
            print("part", kw["PartNumber"], flush=True)
            time.sleep(0.5)  # room for the test to kill us between parts
            return answer
        store._client.upload_part = slow_part
        await store.put_file(Path(src))
        print("done", flush=True)

    asyncio.run(main())
    """
)


def _start_child(store: ObjectStore, src: Path) -> subprocess.Popen[str]:
    cfg = store.config
    return subprocess.Popen(
        [
            sys.executable,
            "-c",
            CHILD,
            cfg.endpoint,
            cfg.bucket,
            str(cfg.access_key),
            str(cfg.secret_key),
            str(store.state_dir),
            str(src),
            str(PART),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )


def _kill_after_parts(child: subprocess.Popen[str], parts: int) -> None:
    assert child.stdout is not None
    seen = 0
    deadline = time.monotonic() + 60
    try:
        while seen < parts and time.monotonic() < deadline:
            line = child.stdout.readline()
            if not line:
                break
            if line.startswith("part "):
                seen += 1
        assert seen == parts, f"the uploader sent {seen} parts, expected at least {parts}"
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
        child.stdout.close()


async def test_upload_resumes_after_sigkill(store: ObjectStore, tmp_path: Path) -> None:
    src = tmp_path / "resumable"
    size = 5 * PART + 4321  # 6 parts
    want = _write(src, size, seed=7)
    child = _start_child(store, src)
    _kill_after_parts(child, 2)
    records = list((store.state_dir / "uploads").glob("*.json"))
    assert len(records) == 1, "a killed upload leaves its record"
    rec = json.loads(records[0].read_text())
    assert rec["digest"] == want
    there = await store.list_parts(want, rec["upload_id"])
    assert 2 <= len(there) < 6, there
    assert await store.has_blob(want) is None

    t0 = time.monotonic()
    digest = await store.put_file(src)
    resume_s = time.monotonic() - t0
    assert digest == want
    assert store.stats.multipart_resumed == 1 and store.stats.multipart_started == 0
    assert store.stats.parts_skipped == len(there)
    assert store.stats.parts_uploaded == 6 - len(there)
    assert store.stats.bytes_uploaded == size - len(there) * PART
    assert not records[0].exists()
    dest = tmp_path / "copy"
    await store.get_file(digest, dest)
    assert hashlib.sha256(dest.read_bytes()).hexdigest() == want
    print(
        f"\nresume: {len(there)} of 6 parts kept, {store.stats.bytes_uploaded / MIB:.1f} "
        f"of {size / MIB:.1f} MiB sent again in {resume_s:.2f}s (no re-hash)"
    )


async def test_corrupt_object_fails_cleanly(store: ObjectStore, tmp_path: Path) -> None:
    src = tmp_path / "orig"
    _write(src, 200_000, seed=1)
    digest = await store.put_file(src)
    bad = bytearray(src.read_bytes())
    bad[100_000] ^= 0xFF
    await asyncio.to_thread(
        _raw_client(store).put_object, Bucket=store.bucket, Key=blob_key(digest), Body=bytes(bad)
    )
    dest_dir = tmp_path / "dl"
    with pytest.raises(BlobDigestMismatch) as err:
        await store.get_file(digest, dest_dir / "copy")
    assert store.bucket in str(err.value) and digest in str(err.value)
    assert list(dest_dir.iterdir()) == []
    with pytest.raises(BlobNotFound):
        await store.get_file("0" * 64, dest_dir / "none")
    assert list(dest_dir.iterdir()) == []


async def test_many_concurrent_puts_and_gets(store: ObjectStore, tmp_path: Path) -> None:
    files = []
    for i in range(32):
        p = tmp_path / f"f{i}"
        files.append((p, _write(p, 64_000 + 1000 * i, seed=100 + i)))
    files.append((tmp_path / "mp", _write(tmp_path / "mp", 2 * PART + 1, seed=99)))
    digests = await asyncio.gather(*(store.put_file(p) for p, _ in files))
    assert digests == [d for _, d in files]
    out = tmp_path / "out"
    await asyncio.gather(*(store.get_file(d, out / d) for d in digests))
    for d in digests:
        assert hashlib.sha256((out / d).read_bytes()).hexdigest() == d
    assert store.stats.downloads == len(files)


async def test_sparse_file_moves_only_its_data(store: ObjectStore, tmp_path: Path) -> None:
    src = tmp_path / "memory"
    with src.open("wb") as fh:
        fh.truncate(256 * MIB)
        for at in (0, 10 * MIB, 100 * MIB + 4096, 255 * MIB):
            fh.seek(at)
            fh.write(os.urandom(3 * 4096) + b"\0" * 8192 + os.urandom(4096))
    source = SparseSource(src)
    try:
        assert source.size < 256 * 1024
        digest = await store.put_source(source)
        extents, file_size = source.extents, source.file_size
    finally:
        source.close()
    assert store.stats.bytes_uploaded < 256 * 1024
    dest = tmp_path / "restored"
    await store.get_into(digest, SparseSink(dest, file_size, extents))
    assert dest.stat().st_size == 256 * MIB
    assert sparse_digest(dest) == sparse_digest(src)
    assert dest.stat().st_blocks <= src.stat().st_blocks


async def test_blob_cache_evicts_lru_and_keeps_pinned(store: ObjectStore, tmp_path: Path) -> None:
    digests = []
    for i in range(5):
        p = tmp_path / f"blob{i}"
        _write(p, MIB, seed=200 + i)
        digests.append(await store.put_file(p))
    pinned = {digests[0]}
    cache = BlobCache(tmp_path / "cache", limit_bytes=10 * MIB, store=store, pins=lambda: pinned)
    for i, d in enumerate(digests[:4]):
        path = await cache.fetch(d)
        assert hashlib.sha256(path.read_bytes()).hexdigest() == d
        os.utime(path, (1000.0 + i, 1000.0 + i))  # a definite LRU order: 0 oldest
    assert cache.usage() >= 4 * MIB
    # Using an entry makes it the most recent.
    cache.touch(digests[1])
    cache.limit_bytes = int(2.5 * MIB)
    assert sorted(cache.evict()) == sorted([digests[2], digests[3]])
    assert cache.has(digests[0]), "a pinned entry is never evicted, oldest or not"
    assert cache.has(digests[1])
    # A fetch trims the cache too, never the entry it fetched.
    await cache.fetch(digests[4])
    assert cache.has(digests[0]) and cache.has(digests[4]) and not cache.has(digests[1])
    assert cache.usage() <= 2.5 * MIB
    # A held entry survives even an eviction to zero.
    async with cache.hold(digests[4]):
        cache.evict(0)
        assert cache.has(digests[4]) and cache.has(digests[0])
    cache.evict(0)
    assert not cache.has(digests[4]) and cache.has(digests[0])
    # An evicted blob comes back from the store on its next use.
    assert hashlib.sha256((await cache.fetch(digests[2])).read_bytes()).hexdigest() == digests[2]
    assert store.stats.downloads == 6


async def test_store_down_fails_within_deadline(tmp_path: Path) -> None:
    with SeaweedFS() as sw:
        # Set up with patient timeouts: a fresh SeaweedFS allocates its volumes on first write.
        async with ObjectStore(sw.config("down-test"), state_dir=tmp_path / "s0") as setup:
            await setup.ensure_bucket()
            src = tmp_path / "x"
            _write(src, 10_000)
            digest = await setup.put_file(src)
        store = ObjectStore(
            sw.config("down-test"),
            state_dir=tmp_path / "state",
            part_size=PART,
            connect_timeout_s=1.0,
            read_timeout_s=2.0,
            max_attempts=2,
            call_timeout_s=8.0,
        )
        try:
            await store.get_file(digest, tmp_path / "ok")
            sw.kill()
            for attempt in (store.put_file(src), store.get_file(digest, tmp_path / "y")):
                t0 = time.monotonic()
                with pytest.raises(ObjectStoreError) as err:
                    await attempt
                took = time.monotonic() - t0
                assert took < 12.0, f"took {took:.1f}s"
                assert "s3://down-test" in str(err.value)
                print(f"\nstore down: {type(err.value).__name__} after {took:.2f}s: {err.value}")
            assert not (tmp_path / "y").exists()
            assert not [p for p in os.listdir(tmp_path) if p.endswith(".partial")]
        finally:
            await store.close()


async def test_the_test_store_gives_many_buckets_few_volumes(tmp_path: Path) -> None:
    """The SeaweedFS of the tests must not run out of volumes when a module makes a bucket per
    test: with a ceiling of 8 volumes, 6 buckets each take an upload (one volume each; at 7 per
    bucket, the `weed` default, the second bucket's upload was an InternalError)."""
    with SeaweedFS(max_volumes=8) as sw:
        src = tmp_path / "x"
        _write(src, 3 * PART)
        for i in range(6):
            async with ObjectStore(
                sw.config(f"many-{i}"), state_dir=tmp_path / f"s{i}", part_size=PART
            ) as store:
                await store.ensure_bucket()
                digest = await store.put_file(src)
                await store.get_file(digest, tmp_path / f"back-{i}")
                assert (tmp_path / f"back-{i}").read_bytes() == src.read_bytes()
