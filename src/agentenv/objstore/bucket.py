"""The bucket's side of the object store: key names (`blob_key`, marks, refs), transfer
counters, and `BucketCalls`: boto3 in the store's own bounded pool with a deadline on every
call, and the small named objects (heads, listings, JSON manifests, marks, deletes). Split
from `client.py`; uploads (`uploads`) and downloads (`client`) are built over it."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import logging
import re
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import boto3
import botocore.exceptions
from botocore.config import Config

from agentenv.config import ObjectStoreConfig
from agentenv.objstore.errors import BlobNotFound, ObjectStoreError

log = logging.getLogger("agentenv.objstore.client")
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
# Below this rate a transfer counts as stuck: a call's deadline grows with its size.
MIN_RATE_BYTES_S = 4 * MIB
_DIGEST = re.compile(r"^[0-9a-f]{64}$")


def blob_key(digest: str) -> str:
    if not _DIGEST.match(digest):
        raise ValueError(f"{digest!r} is not a sha256 hex digest")
    return BLOB_PREFIX + digest


def mark_key(digest: str) -> str:
    return MARK_PREFIX + blob_key(digest)[len(BLOB_PREFIX) :]


def checksum_b64(raw: bytes) -> str:
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


class BucketCalls:
    """One bucket, its client and thread pool, and its small-object calls."""

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
        checksum = checksum_b64(hashlib.sha256(data).digest())
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
