"""Content-addressed blobs in an S3 bucket.

A blob is stored under ``blobs/sha256/<hex>``, the sha256 of its bytes, so the same content
is uploaded once whoever has it. Uploads:

- skip when the object is already there with that size;
- small blobs are one PUT carrying the whole body's SHA-256 (`ChecksumSHA256`), so the store
  verifies it; larger ones are a multipart upload, each part with its own SHA-256;
- a source uploaded before (same path, inode, size, mtime: the layers and memory files are
  immutable) is not read again: its digest is remembered in ``<state_dir>/digests/``;
- resumable: before the first part, the upload id, the digest and the part checksums are
  written to ``<state_dir>/uploads/<hash of the source's identity>.json``. A process killed
  mid-upload leaves that record; the next put of the same source (same path, inode, size,
  mtime) skips the hashing, asks `ListParts` what arrived and sends only the missing parts.

Downloads stream into a sink (`<dest>.partial`), hashing as they go; a digest mismatch
discards what was written and raises `BlobDigestMismatch`.

boto3 is synchronous: every call runs in this store's own bounded thread pool (never the
event loop's default executor, which other work needs), with botocore connect/read timeouts
and a bounded retry count, and every await of it has a deadline that ends in an
`ObjectStoreError` naming the bucket and key.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import json
import logging
import os
import re
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import boto3
import botocore.exceptions
from botocore.config import Config

from agentenv.config import ObjectStoreConfig, Settings
from agentenv.filelock import file_lock
from agentenv.objstore.errors import BlobDigestMismatch, BlobNotFound, ObjectStoreError
from agentenv.objstore.source import BlobSink, BlobSource, FileSink, FileSource

log = logging.getLogger(__name__)

T = TypeVar("T")

MIB = 1024 * 1024
# S3 wants parts of at least 5 MiB (all but the last) and at most 10000 of them.
MIN_PART_SIZE = 5 * MIB
MAX_PARTS = 10000
DEFAULT_PART_SIZE = 64 * MIB
BLOB_PREFIX = "blobs/sha256/"
# `blob-marks/<digest>`: an empty object rewritten whenever a blob is uploaded or found and
# reused, so its LastModified says when some writer last counted on the blob; the bucket's
# garbage collection (`snapshot.remote.RemoteSnapshots.gc_blobs`) spares recently marked ones.
MARK_PREFIX = "blob-marks/"
# `refs/<kind>/<name>.json` = {"blobs": [...]}: blobs something other than a snapshot or
# paused-sandbox manifest counts on (a cluster's uploaded build archives); kept by the
# collection too.
REFS_PREFIX = "refs/"
_HASH_CHUNK = 4 * MIB
_READ_CHUNK = 1 * MIB
# Below this rate a transfer counts as stuck: a call's deadline grows with its size.
MIN_RATE_BYTES_S = 4 * MIB
_DIGEST = re.compile(r"^[0-9a-f]{64}$")


def blob_key(digest: str) -> str:
    if not _DIGEST.match(digest):
        raise ValueError(f"{digest!r} is not a sha256 hex digest")
    return BLOB_PREFIX + digest


def mark_key(digest: str) -> str:
    return MARK_PREFIX + blob_key(digest)[len(BLOB_PREFIX) :]


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


@dataclass
class TransferStats:
    """Counters of what this store sent and fetched (tests and benches read them)."""

    puts_skipped: int = 0
    hashes_skipped: int = 0
    single_puts: int = 0
    multipart_started: int = 0
    multipart_resumed: int = 0
    parts_uploaded: int = 0
    parts_skipped: int = 0
    bytes_uploaded: int = 0
    bytes_downloaded: int = 0
    downloads: int = 0


@dataclass
class _Plan:
    """What an upload needs from a pass over its source."""

    digest: str
    size: int
    part_size: int
    part_checksums: list[str] = field(default_factory=list)  # base64 sha256 per part


class _RangeReader:
    """A seekable file-like view of [offset, offset+length) of a source (botocore rewinds
    bodies on retry)."""

    def __init__(self, source: BlobSource, offset: int, length: int) -> None:
        self._source, self._offset, self._length, self._pos = source, offset, length, 0

    def read(self, n: int = -1) -> bytes:
        left = self._length - self._pos
        n = left if n is None or n < 0 else min(n, left)
        if n <= 0:
            return b""
        data = self._source.read_at(self._offset + self._pos, n)
        self._pos += len(data)
        return data

    def seek(self, pos: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self._pos, os.SEEK_END: self._length}[whence]
        self._pos = max(0, min(self._length, base + pos))
        return self._pos

    def tell(self) -> int:
        return self._pos

    def __len__(self) -> int:
        return self._length


class ObjectStore:
    """One bucket of content-addressed blobs (plus small named objects: manifests)."""

    def __init__(
        self,
        config: ObjectStoreConfig,
        *,
        state_dir: Path,
        part_size: int = DEFAULT_PART_SIZE,
        max_workers: int = 8,
        part_concurrency: int = 2,
        connect_timeout_s: float = 5.0,
        read_timeout_s: float = 60.0,
        max_attempts: int = 3,
        call_timeout_s: float = 120.0,
    ) -> None:
        if part_size < MIN_PART_SIZE:
            raise ValueError(f"part size {part_size} is below S3's minimum {MIN_PART_SIZE}")
        self.config = config
        self.bucket = config.bucket
        self.state_dir = state_dir
        self.part_size = part_size
        self.part_concurrency = max(1, min(part_concurrency, max_workers))
        self.call_timeout_s = call_timeout_s
        self.stats = TransferStats()
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="objstore")
        self._client = boto3.session.Session().client(
            "s3",
            endpoint_url=config.endpoint,
            aws_access_key_id=config.access_key,
            aws_secret_access_key=config.secret_key,
            region_name=config.region,
            config=Config(
                connect_timeout=connect_timeout_s,
                read_timeout=read_timeout_s,
                retries={"total_max_attempts": max_attempts, "mode": "standard"},
                s3={"addressing_style": "path"},
                max_pool_connections=max_workers,
                # We send our own SHA-256 per request; no extra CRC pass by botocore.
                request_checksum_calculation="when_required",
                response_checksum_validation="when_required",
            ),
        )
        self._stats_lock = threading.Lock()

    @classmethod
    def from_settings(cls, settings: Settings, **kwargs: Any) -> ObjectStore | None:
        """The node's object store, or None when none is configured (single node)."""
        if settings.object_store is None:
            return None
        return cls(settings.object_store, state_dir=settings.blobs_dir, **kwargs)

    async def close(self) -> None:
        await asyncio.to_thread(self._pool.shutdown, wait=True, cancel_futures=True)

    async def __aenter__(self) -> ObjectStore:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- calling boto3 ------------------------------------------------------------------------

    def _count(self, **deltas: int) -> None:
        with self._stats_lock:
            for name, delta in deltas.items():
                setattr(self.stats, name, getattr(self.stats, name) + delta)

    async def _call(
        self, what: str, key: str | None, fn: Callable[[], T], *, timeout_s: float | None = None
    ) -> T:
        """Run `fn` in the pool with a deadline; botocore failures become ObjectStoreError."""
        loop = asyncio.get_running_loop()
        deadline = self.call_timeout_s if timeout_s is None else timeout_s
        try:
            return await asyncio.wait_for(loop.run_in_executor(self._pool, fn), deadline)
        except TimeoutError:
            raise ObjectStoreError(
                f"{what}: no answer within {deadline:.0f}s", bucket=self.bucket, key=key
            ) from None
        except botocore.exceptions.ClientError as exc:
            code = exc.response.get("Error", {}).get("Code", "")
            if code in ("NoSuchKey", "404", "NotFound"):
                raise BlobNotFound(f"{what}: not found", bucket=self.bucket, key=key) from exc
            raise ObjectStoreError(f"{what}: {exc}", bucket=self.bucket, key=key) from exc
        except (botocore.exceptions.BotoCoreError, OSError) as exc:
            raise ObjectStoreError(f"{what}: {exc}", bucket=self.bucket, key=key) from exc

    async def _local(self, fn: Callable[[], T]) -> T:
        """Local file work (hashing, records) in this store's pool, not the default one."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn)

    def _deadline(self, nbytes: int) -> float:
        return self.call_timeout_s + nbytes / MIN_RATE_BYTES_S

    # -- small objects -------------------------------------------------------------------------

    async def ensure_bucket(self) -> None:
        """Create the bucket if it does not exist (tests, first node of a cluster)."""

        def run() -> None:
            try:
                self._client.head_bucket(Bucket=self.bucket)
            except botocore.exceptions.ClientError:
                self._client.create_bucket(Bucket=self.bucket)

        await self._call("create bucket", None, run)

    async def _head(self, key: str) -> dict[str, Any] | None:
        """The object's HEAD answer, or None if there is none."""

        def run() -> dict[str, Any] | None:
            try:
                head: dict[str, Any] = self._client.head_object(Bucket=self.bucket, Key=key)
            except botocore.exceptions.ClientError as exc:
                status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
                if status == 404 or exc.response.get("Error", {}).get("Code") in (
                    "404",
                    "NoSuchKey",
                    "NotFound",
                ):
                    return None
                raise
            return head

        return await self._call("head", key, run)

    async def size_of(self, key: str) -> int | None:
        """The object's size, or None if there is none."""
        head = await self._head(key)
        return None if head is None else int(head["ContentLength"])

    async def has_blob(self, digest: str) -> int | None:
        return await self.size_of(blob_key(digest))

    async def modified_at(self, key: str) -> float | None:
        """The object's LastModified (epoch seconds), or None if there is none."""
        head = await self._head(key)
        return None if head is None else float(head["LastModified"].timestamp())

    async def listing(self, prefix: str, *, limit: int = 1_000_000) -> dict[str, float]:
        """Key -> LastModified (epoch seconds) of every object under `prefix`."""

        def run() -> dict[str, float]:
            out: dict[str, float] = {}
            kwargs: dict[str, Any] = {"Bucket": self.bucket, "Prefix": prefix}
            while len(out) < limit:
                page = self._client.list_objects_v2(**kwargs)
                for obj in page.get("Contents", []):
                    out[str(obj["Key"])] = float(obj["LastModified"].timestamp())
                if not page.get("IsTruncated"):
                    break
                kwargs["ContinuationToken"] = page["NextContinuationToken"]
            return out

        return await self._call("list", prefix, run)

    async def mark(self, digest: str) -> None:
        """Note that a writer counts on this blob now (see `MARK_PREFIX`)."""
        await self.put_bytes(mark_key(digest), b"")

    async def put_bytes(self, key: str, data: bytes) -> None:
        checksum = _b64(hashlib.sha256(data).digest())
        await self._call(
            "put",
            key,
            partial(
                self._client.put_object,
                Bucket=self.bucket,
                Key=key,
                Body=data,
                ChecksumSHA256=checksum,
            ),
        )

    async def get_bytes(self, key: str) -> bytes:
        def run() -> bytes:
            body = self._client.get_object(Bucket=self.bucket, Key=key)["Body"]
            try:
                data: bytes = body.read()
            finally:
                body.close()
            return data

        return await self._call("get", key, run)

    async def put_json(self, key: str, doc: Any) -> None:
        await self.put_bytes(key, json.dumps(doc, sort_keys=True).encode())

    async def get_json(self, key: str) -> Any:
        raw = await self.get_bytes(key)
        try:
            return json.loads(raw)
        except ValueError as exc:
            raise ObjectStoreError(f"not JSON: {exc}", bucket=self.bucket, key=key) from exc

    async def list_keys(self, prefix: str, *, limit: int = 100_000) -> list[str]:
        """Keys under `prefix` (at most `limit`, in pages of 1000)."""

        def run() -> list[str]:
            keys: list[str] = []
            kwargs: dict[str, Any] = {"Bucket": self.bucket, "Prefix": prefix}
            while len(keys) < limit:
                page = self._client.list_objects_v2(**kwargs)
                keys.extend(str(o["Key"]) for o in page.get("Contents", []))
                if not page.get("IsTruncated"):
                    break
                kwargs["ContinuationToken"] = page["NextContinuationToken"]
            return keys[:limit]

        return await self._call("list", prefix, run)

    async def delete(self, key: str) -> None:
        await self._call(
            "delete", key, partial(self._client.delete_object, Bucket=self.bucket, Key=key)
        )

    # -- uploads ---------------------------------------------------------------------------------

    def _record_path(self, identity: dict[str, Any]) -> Path:
        # Per bucket too: one data dir may talk to more than one store.
        where = {"endpoint": self.config.endpoint, "bucket": self.bucket, **identity}
        name = hashlib.sha256(json.dumps(where, sort_keys=True).encode()).hexdigest()[:32]
        return self.state_dir / "uploads" / f"{name}.json"

    def _known_path(self, identity: dict[str, Any]) -> Path:
        """Where the digest of a source this store uploaded (or found present) is kept."""
        return self.state_dir / "digests" / self._record_path(identity).name

    def _read_record(self, path: Path, identity: dict[str, Any]) -> dict[str, Any] | None:
        try:
            rec: dict[str, Any] = json.loads(path.read_text())
        except (OSError, ValueError):
            return None
        return rec if rec.get("identity") == identity else None

    @staticmethod
    def _write_record(path: Path, rec: dict[str, Any]) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(rec, sort_keys=True))
        os.replace(tmp, path)

    def _hash(self, source: BlobSource, part_size: int) -> _Plan:
        """One pass: the blob's digest and each part's checksum."""
        whole = hashlib.sha256()
        plan = _Plan(digest="", size=source.size, part_size=part_size)
        offset = 0
        while offset < source.size:
            part = hashlib.sha256()
            end = min(source.size, offset + part_size)
            while offset < end:
                chunk = source.read_at(offset, min(_HASH_CHUNK, end - offset))
                if not chunk:
                    raise OSError(f"source ended at {offset} of {source.size} bytes")
                whole.update(chunk)
                part.update(chunk)
                offset += len(chunk)
            plan.part_checksums.append(_b64(part.digest()))
        if not plan.part_checksums:  # the empty blob
            plan.part_checksums.append(_b64(hashlib.sha256().digest()))
        plan.digest = whole.hexdigest()
        return plan

    def _part_size_for(self, size: int) -> int:
        part = self.part_size
        while size > part * MAX_PARTS:
            part *= 2
        return part

    async def put_file(self, path: Path) -> str:
        """Upload a file's bytes as a blob; returns its digest (the sha256 of the bytes)."""
        source = await self._local(partial(FileSource, path))
        try:
            return await self.put_source(source)
        finally:
            source.close()

    async def put_source(self, source: BlobSource) -> str:
        """Upload a source as a blob (see the module docstring); returns its digest."""
        identity = source.identity()
        record_path = self._record_path(identity)
        await asyncio.to_thread(record_path.parent.mkdir, 0o700, True, True)
        # One upload per source at a time, across processes too: they would share the record.
        async with file_lock(
            record_path.with_suffix(".lock"),
            name=f"the upload lock of {identity.get('path', '?')}",
            timeout_s=self._deadline(source.size) * 2,
            waiter="an upload",
        ):
            known_path = self._known_path(identity)
            known = await asyncio.to_thread(self._read_record, known_path, identity)
            if known is not None and await self.size_of(blob_key(known["digest"])) == known["size"]:
                # Uploaded before from this very file: no need to read it again.
                self._count(puts_skipped=1, hashes_skipped=1)
                await self.mark(str(known["digest"]))
                return str(known["digest"])
            rec = await asyncio.to_thread(self._read_record, record_path, identity)
            if rec is not None:
                plan = _Plan(rec["digest"], rec["size"], rec["part_size"], rec["part_checksums"])
            else:
                part_size = self._part_size_for(source.size)
                plan = await self._local(partial(self._hash, source, part_size))
            key = blob_key(plan.digest)
            if await self.size_of(key) == plan.size:
                self._count(puts_skipped=1)
                if rec is not None:
                    await self._abort(key, rec.get("upload_id"))
                    await asyncio.to_thread(record_path.unlink, True)
            elif plan.size <= plan.part_size:
                await self._single_put(source, key, plan)
            else:
                await self._multipart(source, key, plan, rec, record_path, identity)
            done = {"identity": identity, "digest": plan.digest, "size": plan.size}
            await asyncio.to_thread(self._write_record, known_path, done)
            await self.mark(plan.digest)
            return plan.digest

    async def _single_put(self, source: BlobSource, key: str, plan: _Plan) -> None:
        await self._call(
            "put",
            key,
            partial(
                self._client.put_object,
                Bucket=self.bucket,
                Key=key,
                Body=_RangeReader(source, 0, plan.size),
                ContentLength=plan.size,
                ChecksumSHA256=plan.part_checksums[0],
            ),
            timeout_s=self._deadline(plan.size),
        )
        self._count(single_puts=1, bytes_uploaded=plan.size)

    async def _existing_parts(self, key: str, upload_id: str) -> dict[int, dict[str, Any]] | None:
        """Parts an upload already holds, or None if the upload is gone."""

        def run() -> dict[int, dict[str, Any]] | None:
            parts: dict[int, dict[str, Any]] = {}
            marker = 0
            for _ in range(MAX_PARTS // 1000 + 2):  # pages of up to 1000 parts
                try:
                    page = self._client.list_parts(
                        Bucket=self.bucket, Key=key, UploadId=upload_id, PartNumberMarker=marker
                    )
                except botocore.exceptions.ClientError as exc:
                    if exc.response.get("Error", {}).get("Code") in ("NoSuchUpload", "404"):
                        return None
                    raise
                for p in page.get("Parts", []):
                    parts[int(p["PartNumber"])] = p
                if not page.get("IsTruncated"):
                    break
                marker = int(page["NextPartNumberMarker"])
            return parts

        return await self._call("list parts", key, run)

    async def list_parts(self, digest: str, upload_id: str) -> list[int]:
        """Part numbers an upload of `digest` holds (tests: what a resume will skip)."""
        parts = await self._existing_parts(blob_key(digest), upload_id)
        return sorted(parts or {})

    async def _abort(self, key: str, upload_id: str | None) -> None:
        if not upload_id:
            return
        with contextlib.suppress(ObjectStoreError):
            await self._call(
                "abort upload",
                key,
                partial(
                    self._client.abort_multipart_upload,
                    Bucket=self.bucket,
                    Key=key,
                    UploadId=upload_id,
                ),
            )

    async def _multipart(
        self,
        source: BlobSource,
        key: str,
        plan: _Plan,
        rec: dict[str, Any] | None,
        record_path: Path,
        identity: dict[str, Any],
    ) -> None:
        nparts = len(plan.part_checksums)
        have: dict[int, dict[str, Any]] = {}
        upload_id = rec.get("upload_id") if rec else None
        if upload_id:
            found = await self._existing_parts(key, upload_id)
            if found is None:
                upload_id = None
            else:
                have = found
                self._count(multipart_resumed=1)
        if not upload_id:
            created = await self._call(
                "start upload",
                key,
                partial(
                    self._client.create_multipart_upload,
                    Bucket=self.bucket,
                    Key=key,
                    ChecksumAlgorithm="SHA256",
                ),
            )
            upload_id = str(created["UploadId"])
            self._count(multipart_started=1)
            rec = {
                "identity": identity,
                "digest": plan.digest,
                "size": plan.size,
                "part_size": plan.part_size,
                "part_checksums": plan.part_checksums,
                "upload_id": upload_id,
                "key": key,
                "started_at": time.time(),
            }
            await asyncio.to_thread(self._write_record, record_path, rec)
        etags: dict[int, str] = {}
        for number, part in have.items():
            expected = min(plan.part_size, plan.size - (number - 1) * plan.part_size)
            if 1 <= number <= nparts and int(part.get("Size", -1)) == expected:
                etags[number] = str(part["ETag"])
        self._count(parts_skipped=len(etags))
        missing = [n for n in range(1, nparts + 1) if n not in etags]
        gate = asyncio.Semaphore(self.part_concurrency)

        async def send(number: int) -> None:
            offset = (number - 1) * plan.part_size
            length = min(plan.part_size, plan.size - offset)
            async with gate:
                answer = await self._call(
                    f"upload part {number}/{nparts}",
                    key,
                    partial(
                        self._client.upload_part,
                        Bucket=self.bucket,
                        Key=key,
                        UploadId=upload_id,
                        PartNumber=number,
                        Body=_RangeReader(source, offset, length),
                        ContentLength=length,
                        ChecksumSHA256=plan.part_checksums[number - 1],
                    ),
                    timeout_s=self._deadline(length),
                )
            etags[number] = str(answer["ETag"])
            self._count(parts_uploaded=1, bytes_uploaded=length)

        async with asyncio.TaskGroup() as tg:
            for number in missing:
                tg.create_task(send(number))
        parts = [
            {"PartNumber": n, "ETag": etags[n], "ChecksumSHA256": plan.part_checksums[n - 1]}
            for n in range(1, nparts + 1)
        ]
        await self._call(
            "complete upload",
            key,
            partial(
                self._client.complete_multipart_upload,
                Bucket=self.bucket,
                Key=key,
                UploadId=upload_id,
                MultipartUpload={"Parts": parts},
            ),
            timeout_s=self._deadline(plan.size // 8),
        )
        size = await self.size_of(key)
        if size != plan.size:
            raise ObjectStoreError(
                f"completed upload holds {size} bytes, expected {plan.size}",
                bucket=self.bucket,
                key=key,
            )
        await asyncio.to_thread(record_path.unlink, True)

    # -- downloads ---------------------------------------------------------------------------

    async def get_file(self, digest: str, dest: Path, *, mode: int = 0o644) -> None:
        """Download a blob to `dest` (through `<dest>.partial`, verified, then renamed)."""
        sink = await asyncio.to_thread(FileSink, dest, mode)
        await self.get_into(digest, sink)

    async def get_into(self, digest: str, sink: BlobSink) -> int:
        """Stream a blob into `sink`, verifying its sha256; commits the sink on success and
        discards it on any failure. Returns the blob's size."""
        key = blob_key(digest)
        cancelled = threading.Event()
        try:
            size = await self.size_of(key)
            if size is None:
                raise BlobNotFound("no such blob", bucket=self.bucket, key=key)

            def run() -> str:
                resp = self._client.get_object(Bucket=self.bucket, Key=key)
                body = resp["Body"]
                h = hashlib.sha256()
                got = 0
                try:
                    while not cancelled.is_set():
                        chunk = body.read(_READ_CHUNK)
                        if not chunk:
                            break
                        h.update(chunk)
                        sink.write(chunk)
                        got += len(chunk)
                finally:
                    body.close()
                if cancelled.is_set():
                    raise OSError("cancelled")
                if got != size:
                    raise OSError(f"stream ended at {got} of {size} bytes")
                return h.hexdigest()

            actual = await self._call("get", key, run, timeout_s=self._deadline(size))
            if actual != digest:
                raise BlobDigestMismatch(
                    f"downloaded bytes hash to {actual[:16]}…, not the key's digest",
                    bucket=self.bucket,
                    key=key,
                )
            await asyncio.to_thread(sink.commit)
        except BaseException:
            cancelled.set()
            await asyncio.shield(asyncio.to_thread(sink.discard))
            raise
        self._count(downloads=1, bytes_downloaded=size)
        return size
