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

The parts: `bucket` (keys, calls, small objects), `uploads` (puts); this module adds the
downloads and the store's own lifetime.
"""

from __future__ import annotations

import asyncio
import hashlib
import threading
from pathlib import Path
from typing import Any

from agentenv.config import Settings
from agentenv.objstore.bucket import MIB, blob_key
from agentenv.objstore.errors import BlobDigestMismatch, BlobNotFound
from agentenv.objstore.source import BlobSink, FileSink
from agentenv.objstore.uploads import BlobUploads

_READ_CHUNK = 1 * MIB


class ObjectStore(BlobUploads):
    """One bucket of content-addressed blobs (plus small named objects: manifests)."""

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
