"""The `BuildStore` of a cluster: template and build records in etcd, uploaded COPY archives in
object storage, so a template requested through one control-plane replica is uploaded to,
started, polled, tagged and created from through any other.

Keys (under the cluster prefix, values JSON):
- `build-templates/<name>`: a `TemplateRecord`; `build-builds/<id>`: a `BuildRecord`. Every
  write that depends on what was read is a compare-and-set on the key's mod revision, retried
  after re-reading; each value carries a random `_w` mark so a retried transaction whose first
  answer was lost recognises its own write.
- `build-logs/<id>/<seq>`: the log in chunks. The replica running the build buffers lines and
  writes a chunk at most every `FLUSH_S` (or when it is large), so a build that prints a line
  per millisecond is a few writes per second; the builder flushes before it records the end of
  a build, so whoever sees `ready` or `error` sees every line before it.
- `build-files/<hash>`: the digest of the uploaded archive; the archive itself is a
  content-addressed blob in the bucket (`objstore`), fetched by the replica that runs the build,
  and named by `refs/build-files/<hash>.json` so the bucket's collection keeps it.
  Without an object store (`AGENTENV_S3_*` unset) archives stay on the replica that received
  them, and only that replica's builds find them.
- `build-snapshots/<name>`: the builder's own snapshot names (step cache, captured templates)
  → snapshot id, and `build-snapshot-ids/<id>` the other way (a create by such an id is
  refused, as on one server). The snapshots themselves are on the nodes and in the bucket.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import secrets
import time
from pathlib import Path
from typing import Any

from agentenv.build.state import (
    BuildRecord,
    LogLine,
    TemplateChange,
    TemplateRecord,
    build_from,
    log_row,
    template_from,
)
from agentenv.cluster.etcd import CasConflict, Etcd, KeyValue, cas, put_op
from agentenv.objstore import ObjectStore
from agentenv.objstore.bucket import REFS_PREFIX

log = logging.getLogger(__name__)

TEMPLATES = "build-templates"
BUILDS = "build-builds"
LOGS = "build-logs"
FILES = "build-files"
SNAPSHOTS = "build-snapshots"
SNAPSHOT_IDS = "build-snapshot-ids"
# How long a logged line may wait for its chunk to be written.
FLUSH_S = 0.25
# A chunk stays well under etcd's request limit (1.5 MiB by default).
CHUNK_BYTES = 256 * 1024
# One line longer than this is cut (a binary blob on stdout must not make a chunk too large).
MAX_LINE_CHARS = 16 * 1024


class BuildStoreConflict(CasConflict):
    """A compare-and-set kept losing to other writers (`cluster.etcd.cas`)."""


def _dumps(data: dict[str, Any]) -> bytes:
    return json.dumps(data, separators=(",", ":"), sort_keys=True).encode()


def _marked(record: dict[str, Any]) -> bytes:
    """A record as written by one compare-and-set attempt: a random mark makes the value
    unique, so an attempt whose answer was lost knows its own write when it reads it back."""
    return _dumps({**record, "_w": secrets.token_hex(8)})


def _data(kv: KeyValue) -> dict[str, Any]:
    raw = json.loads(kv.value)
    if not isinstance(raw, dict):
        raise ValueError(f"{kv.key!r}: not a JSON object")
    return raw


def _record(data: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in data.items() if k != "_w"}


class EtcdBuildState:
    """One instance per event loop (its `Etcd` client's)."""

    def __init__(self, etcd: Etcd, objects: ObjectStore | None, local_root: Path) -> None:
        self.etcd = etcd
        self.objects = objects
        # Fetched and received archives (a cache: what is in the bucket can be fetched again).
        self.files_dir = local_root / "files"
        self.files_dir.mkdir(parents=True, exist_ok=True)
        # Lines logged here not yet written, per build, and the task writing them.
        self._pending: dict[str, list[LogLine]] = {}
        self._flushers: dict[str, asyncio.Task[None]] = {}
        self._seq: dict[str, int] = {}
        self._bucket_ready = False

    # -- templates -------------------------------------------------------------------------

    def _tkey(self, template_id: str) -> bytes:
        return self.etcd.key(TEMPLATES, template_id)

    async def template(self, template_id: str) -> TemplateRecord | None:
        kv = await self.etcd.get(self._tkey(template_id))
        return None if kv is None else template_from(_record(_data(kv)))

    async def templates(self) -> list[TemplateRecord]:
        kvs, _ = await self.etcd.get_prefix(self.etcd.dir(TEMPLATES))
        return [template_from(_record(_data(kv))) for kv in kvs]

    async def update_template(
        self, template_id: str, change: TemplateChange
    ) -> TemplateRecord | None:
        current: TemplateRecord | None = None
        new: TemplateRecord | None = None

        def rewrite(kv: KeyValue | None) -> bytes | None:
            nonlocal current, new
            current = None if kv is None else template_from(_record(_data(kv)))
            new = change(None if current is None else dataclasses.replace(current))
            return None if new is None else _marked(dataclasses.asdict(new))

        written = await cas(
            self.etcd, self._tkey(template_id), rewrite, f"template {template_id}",
            conflict=BuildStoreConflict,
        )  # fmt: skip
        return current if written is None else new

    async def drop_template(self, template_id: str) -> TemplateRecord | None:
        key = self._tkey(template_id)
        kv = await self.etcd.get(key)
        if kv is None:
            return None
        await self.etcd.delete(key)
        return template_from(_record(_data(kv)))

    # -- builds ----------------------------------------------------------------------------

    def _bkey(self, build_id: str) -> bytes:
        return self.etcd.key(BUILDS, build_id)

    async def build(self, build_id: str) -> BuildRecord | None:
        kv = await self.etcd.get(self._bkey(build_id))
        return None if kv is None else build_from(_record(_data(kv)))

    async def builds(self) -> list[BuildRecord]:
        kvs, _ = await self.etcd.get_prefix(self.etcd.dir(BUILDS))
        return [build_from(_record(_data(kv))) for kv in kvs]

    async def put_build(self, rec: BuildRecord, *, expect_status: str | None = None) -> bool:
        def rewrite(kv: KeyValue | None) -> bytes | None:
            if expect_status is not None and (
                kv is None or _data(kv).get("status") != expect_status
            ):
                return None
            return _marked(dataclasses.asdict(rec))

        written = await cas(
            self.etcd, self._bkey(rec.build_id), rewrite, f"build {rec.build_id}",
            conflict=BuildStoreConflict,
        )  # fmt: skip
        return written is not None

    async def drop_build(self, build_id: str) -> None:
        task = self._flushers.pop(build_id, None)
        if task is not None:
            task.cancel()
        self._pending.pop(build_id, None)
        await self.etcd.delete(self._bkey(build_id))
        await self.etcd.call(
            "delete prefix",
            lambda c: c.delete_prefix(self.etcd.dir(LOGS, build_id)),
        )

    # -- logs ------------------------------------------------------------------------------

    def log(
        self, build_id: str, message: str, level: str = "info", step: str | None = None
    ) -> None:
        if len(message) > MAX_LINE_CHARS:
            message = message[:MAX_LINE_CHARS] + f" … [{len(message) - MAX_LINE_CHARS} more]"
        self._pending.setdefault(build_id, []).append(LogLine(time.time(), level, message, step))
        task = self._flushers.get(build_id)
        if task is None or task.done():
            self._flushers[build_id] = asyncio.get_running_loop().create_task(
                self._flush_later(build_id), name=f"build-log-{build_id[:8]}"
            )

    async def _flush_later(self, build_id: str) -> None:
        await asyncio.sleep(FLUSH_S)
        try:
            await self._write_pending(build_id)
        except Exception:
            # Kept pending: the next line's flush (or the build's end) tries again.
            log.warning("build %s: log lines not written yet", build_id, exc_info=True)

    async def _seq_of(self, build_id: str) -> int:
        if build_id not in self._seq:
            kvs, _ = await self.etcd.get_prefix(self.etcd.dir(LOGS, build_id))
            self._seq[build_id] = len(kvs)
        return self._seq[build_id]

    async def _write_pending(self, build_id: str) -> None:
        while self._pending.get(build_id):
            lines = self._pending[build_id]
            chunk: list[list[Any]] = []
            size = 0
            for line in lines:
                row = log_row(line)
                size += len(json.dumps(row))
                if chunk and size > CHUNK_BYTES:
                    break
                chunk.append(row)
            seq = await self._seq_of(build_id)
            key = self.etcd.key(LOGS, build_id, f"{seq:010d}")
            await self.etcd.put(key, json.dumps(chunk).encode())
            self._seq[build_id] = seq + 1
            # Lines logged while the put ran were appended after the chunk's.
            del self._pending[build_id][: len(chunk)]
        self._pending.pop(build_id, None)

    async def flush_logs(self, build_id: str) -> None:
        task = self._flushers.pop(build_id, None)
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self._write_pending(build_id)

    async def logs(self, build_id: str) -> list[LogLine]:
        kvs, _ = await self.etcd.get_prefix(self.etcd.dir(LOGS, build_id))
        lines: list[LogLine] = []
        for kv in sorted(kvs, key=lambda kv: kv.key):
            for ts, level, message, step in json.loads(kv.value):
                lines.append(LogLine(ts, level, message, step))
        # What this replica logged and has not written yet comes after what it wrote.
        return lines + list(self._pending.get(build_id, []))

    # -- uploaded files --------------------------------------------------------------------

    def _local(self, files_hash: str) -> Path:
        return self.files_dir / f"{files_hash}.tar"

    async def has_files(self, files_hash: str) -> bool:
        if self._local(files_hash).exists():
            return True
        return await self.etcd.get(self.etcd.key(FILES, files_hash)) is not None

    async def _bucket(self) -> ObjectStore | None:
        if self.objects is not None and not self._bucket_ready:
            await self.objects.ensure_bucket()
            self._bucket_ready = True
        return self.objects

    async def put_files(self, files_hash: str, path: Path) -> None:
        local = self._local(files_hash)
        objects = await self._bucket()
        if objects is not None:
            digest = await objects.put_file(path)
            # The bucket's collection keeps what a ref names; a blob it took between the
            # upload and the ref is uploaded again.
            await objects.put_json(
                f"{REFS_PREFIX}build-files/{files_hash}.json", {"blobs": [digest]}
            )
            if await objects.has_blob(digest) is None:
                digest = await objects.put_file(path)
            await self.etcd.put(
                self.etcd.key(FILES, files_hash), json.dumps({"digest": digest}).encode()
            )
        await asyncio.to_thread(path.replace, local)

    async def files(self, files_hash: str) -> Path | None:
        local = self._local(files_hash)
        if local.exists():
            return local
        kv = await self.etcd.get(self.etcd.key(FILES, files_hash))
        objects = await self._bucket()
        if kv is None or objects is None:
            return None
        await objects.get_file(str(_data(kv)["digest"]), local)
        return local

    def staging(self) -> Path:
        return self.files_dir

    # -- the builder's snapshot names ------------------------------------------------------

    async def snapshot_named(self, name: str) -> str | None:
        kv = await self.etcd.get(self.etcd.key(SNAPSHOTS, name))
        if kv is None:
            return None
        found = _data(kv).get("snapshot_id")
        return found if isinstance(found, str) else None

    async def name_snapshot(self, name: str, snapshot_id: str) -> None:
        await self.etcd.txn(
            [],
            [
                put_op(
                    self.etcd.key(SNAPSHOTS, name),
                    json.dumps({"snapshot_id": snapshot_id}).encode(),
                ),
                put_op(self.etcd.key(SNAPSHOT_IDS, snapshot_id), b"{}"),
            ],
        )

    async def is_builder_snapshot(self, snapshot_id: str) -> bool:
        return await self.etcd.get(self.etcd.key(SNAPSHOT_IDS, snapshot_id)) is not None

    async def close(self) -> None:
        """Writes what is pending, then closes the etcd client (this state owns it; the
        shared catalog reads through it too, and closes with it)."""
        for build_id in list(self._pending):
            with contextlib.suppress(Exception):
                await self.flush_logs(build_id)
        if self.objects is not None:
            await self.objects.close()
        await self.etcd.close()
