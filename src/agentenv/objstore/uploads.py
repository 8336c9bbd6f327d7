"""Uploading a blob (`BlobUploads.put_file`/`put_source`): hashed once (remembered digests of
immutable sources), skipped when the bucket has it, one checksummed PUT when small, else a
multipart upload whose record lets a killed process resume with the missing parts only.
Split from `client.py`."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import botocore.exceptions

from agentenv.filelock import file_lock
from agentenv.objstore.bucket import MAX_PARTS, MIB, BucketCalls, blob_key, checksum_b64
from agentenv.objstore.errors import ObjectStoreError
from agentenv.objstore.source import BlobSource, FileSource

_HASH_CHUNK = 4 * MIB


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


class BlobUploads(BucketCalls):
    """Deduplicated, verified and resumable uploads."""

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
            plan.part_checksums.append(checksum_b64(part.digest()))
        if not plan.part_checksums:  # the empty blob
            plan.part_checksums.append(checksum_b64(hashlib.sha256().digest()))
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
