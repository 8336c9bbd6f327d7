"""Snapshots in object storage: push one from this node, pull one into any other node.

A pushed snapshot is its files as content-addressed blobs (`agentenv.objstore`) plus one small
manifest object, ``snapshots/<id>.json``, listing them:

- every disk layer of its chain (bottom → top) by layer digest, with the blob of the layer
  file's bytes and the backing path it had. A layer's backing file is an absolute path into
  the pushing node's layer store, so a node whose store lives elsewhere re-points it at its
  own copy of the parent (`qemu-img rebase -u`, header only) before the layer is visible.
  The layer keeps its digest (the snapshot id and every chain above it name it); its bytes
  then differ from the pushing node's in the header's backing path only;
- the memory file as a sparse blob (only its data extents travel, `objstore.sparse`) with
  its extent list and size; the device state file as a blob;
- the tools layer the guest had mounted (restores need that very file at that path).

A pull fetches only what this node lacks, verifies each blob's sha256 while streaming, then
commits the memory and state through `SnapshotRepository.commit`, which recomputes the
snapshot id from the files: the id must come out equal to the manifest's, so the whole
snapshot is checked end to end. Nothing is visible before that commit: blobs land as
``*.partial`` files and in a staging directory, both removable (`repo.gc`, `layers.gc`, or
`cleanup_partials`) if the process dies. Concurrent pulls of one snapshot fetch once: an
asyncio lock per snapshot in this process, `filelock.file_lock` across processes.

A paused sandbox (`push_paused`/`pull_paused`, ``paused/<sandbox id>.json``) travels the same
way: the layers under its upper, then its workdir's record, `sandbox.json`, upper (re-pointed
like a layer) and saved RAM, assembled beside the target and renamed into place, with the
sandbox's reference on its top layer taken before the rename.

A pulled snapshot is held by `CACHE_HOLDER` (so `repo.gc` keeps it) and is evictable:
`evict` deletes pulled snapshots that nothing else holds or names, least recently used
first (`touch` on every use), until they fit the node's blob cache limit. Eviction works on
the repository's own references; it keeps no counts of its own.

The parts: `remote_manifest` (keys, manifest, errors), `remote_transfer` (layers and tools
moved one at a time), `remote_paused` (paused sandboxes), `remote_cache` (pulled snapshots as
a cache); this module pushes, pulls and deletes snapshots and collects the bucket.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Sequence
from pathlib import Path

from agentenv.config import Settings
from agentenv.filelock import file_lock
from agentenv.objstore import ObjectStore, SparseSink, SparseSource
from agentenv.objstore.bucket import BLOB_PREFIX, MARK_PREFIX, REFS_PREFIX, blob_key, mark_key
from agentenv.objstore.errors import BlobNotFound
from agentenv.snapshot.errors import SnapshotError, SnapshotNotFound
from agentenv.snapshot.model import Snapshot
from agentenv.snapshot.remote_cache import CACHE_HOLDER, RemoteCache
from agentenv.snapshot.remote_manifest import (
    GC_GRACE_S,
    MANIFEST_PREFIX,
    PAUSED_PREFIX,
    PULL_LOCK_TIMEOUT_S,
    PUSH_ATTEMPTS,
    IncompletePush,
    Manifest,
    RemoteSnapshotError,
    _paused_blobs,
    manifest_key,
)
from agentenv.snapshot.remote_paused import RemotePaused
from agentenv.snapshot.remote_transfer import log
from agentenv.snapshot.repository import MEMORY, STATE


class RemoteSnapshots(RemotePaused, RemoteCache):
    """Push and pull snapshots between this node's repository and an object store."""

    @classmethod
    def from_settings(cls, settings: Settings, store: ObjectStore) -> RemoteSnapshots:
        from agentenv.snapshot.templates import repository

        repo = repository(settings)
        return cls(
            store,
            repo,
            repo.layers,
            state_dir=settings.blobs_dir,
            cache_limit_bytes=settings.blob_cache_mb * 1024 * 1024,
        )

    async def push(self, ref: str, *, include_tools: bool = True) -> Manifest:
        """Upload snapshot `ref` (id or name) and everything it needs; returns its manifest.
        Blobs already in the bucket are not sent again; the manifest goes last, so a
        snapshot whose manifest exists is complete in the bucket."""
        for attempt in range(PUSH_ATTEMPTS):
            try:
                return await self._push_once(ref, include_tools)
            except IncompletePush:
                if attempt == PUSH_ATTEMPTS - 1:
                    raise
        raise AssertionError("unreachable")

    async def _push_once(self, ref: str, include_tools: bool) -> Manifest:
        snap = await asyncio.to_thread(self.repo.get, ref)
        remote_layers = await self._push_chain(snap.top_layer)
        if [layer.digest for layer in remote_layers] != snap.layers:
            log.warning("snapshot %s: its layer list differs from its top layer's chain", snap.id)
        memory = state = tools = None
        if snap.memory:
            source = await asyncio.to_thread(SparseSource, self.repo.memory_path(snap.id))
            try:
                blob = await self.store.put_source(source)
                memory = {
                    "blob": blob,
                    "size": source.size,
                    "file_size": source.file_size,
                    "extents": [list(e) for e in source.extents],
                }
            finally:
                source.close()
            state_path = self.repo.state_path(snap.id)
            state = {
                "blob": await self.store.put_file(state_path),
                "size": (await asyncio.to_thread(state_path.stat)).st_size,
            }
        if include_tools and snap.memory:
            tools = await self._push_tools(Path(snap.tools_image))
        manifest = Manifest(snap, remote_layers, memory, state, tools)
        await self.store.put_json(manifest_key(snap.id), manifest.to_dict())
        await self._check_complete(manifest.blobs(), f"snapshot {snap.id}")
        await asyncio.to_thread(self._keep_manifest, manifest)
        return manifest

    async def remote_ids(self) -> list[str]:
        """Ids of every snapshot pushed to the bucket."""
        keys = await self.store.list_keys(MANIFEST_PREFIX)
        return sorted(k[len(MANIFEST_PREFIX) : -len(".json")] for k in keys if k.endswith(".json"))

    async def pull(
        self, snapshot_id: str, *, names: Sequence[str] = (), holders: Sequence[str] = ()
    ) -> Snapshot:
        """Make snapshot `snapshot_id` present in this node's repository (no work if it is);
        `names` and `holders` are taken on it in the same step. Fetches only missing layers
        and files; every blob is verified, and the committed id must equal the manifest's."""
        async with self._lock(snapshot_id):
            lock = self.state_dir / "locks" / f"snapshot-{snapshot_id}.lock"
            await asyncio.to_thread(lock.parent.mkdir, 0o700, True, True)
            async with file_lock(
                lock,
                name=f"the pull lock of snapshot {snapshot_id[:12]}",
                timeout_s=PULL_LOCK_TIMEOUT_S,
                waiter="a snapshot pull",
            ):
                return await self._pull_locked(snapshot_id, names, holders)

    async def _pull_locked(
        self, snapshot_id: str, names: Sequence[str], holders: Sequence[str]
    ) -> Snapshot:
        with contextlib.suppress(SnapshotNotFound):
            local = await asyncio.to_thread(self.repo.get, snapshot_id)
            for holder in holders:
                await asyncio.to_thread(self.repo.ref, local.id, holder)
            for name in names:
                await asyncio.to_thread(self.repo.add_name, local.id, name)
            await asyncio.to_thread(self.touch, local.id)
            return await asyncio.to_thread(self.repo.get, local.id)
        manifest = await self.manifest(snapshot_id)
        snap = manifest.snapshot
        if snap.id != snapshot_id:
            raise RemoteSnapshotError(f"manifest of {snapshot_id} describes {snap.id}")
        for layer in manifest.layers:
            await self._pull_layer(layer)
        if manifest.tools is not None:
            await self._pull_tools(manifest.tools)
        staging = await asyncio.to_thread(self.repo.stage)
        try:
            if manifest.memory is not None and manifest.state is not None:
                mem = manifest.memory
                sink = await asyncio.to_thread(
                    SparseSink, staging / MEMORY, int(mem["file_size"]), mem["extents"]
                )
                await self.store.get_into(mem["blob"], sink)
                await self.store.get_file(manifest.state["blob"], staging / STATE)
            draft = Snapshot.from_dict(
                {
                    **snap.to_dict(),
                    "names": list(names),
                    "holders": [CACHE_HOLDER, *holders],
                    "deleted": False,
                }
            )
            committed = await asyncio.to_thread(self.repo.commit, staging, draft)
        except BaseException:
            await asyncio.to_thread(self.repo.discard, staging)
            raise
        if committed.id != snap.id:
            with contextlib.suppress(SnapshotError):
                await asyncio.to_thread(self.repo.delete, committed.id)
            raise RemoteSnapshotError(
                f"snapshot {snap.id} pulled from {self.store.bucket} commits as {committed.id}: "
                "its files are not what was pushed"
            )
        await asyncio.to_thread(self._keep_manifest, manifest)
        if self.cache_limit_bytes is not None:
            # Room for what came in: older pulled snapshots nobody uses go (never this one).
            evicted = await asyncio.to_thread(self.evict, keep={committed.id})
            if evicted:
                log.info("evicted pulled snapshots %s to stay under the cache limit", evicted)
        return committed

    async def delete(self, snapshot_id: str) -> bool:
        """Drop a snapshot's manifest: no node fetches it from here any more. Its blobs stay
        for any other manifest that names them. False: the bucket had no such snapshot."""
        self._manifest_copy(snapshot_id).unlink(missing_ok=True)
        if not await self.exists(snapshot_id):
            return False
        await self.store.delete(manifest_key(snapshot_id))
        return True

    async def referenced_blobs(self) -> set[str]:
        """Every blob a snapshot manifest, a paused sandbox's manifest or a ref names."""
        out: set[str] = set()
        for key in await self.store.list_keys(MANIFEST_PREFIX):
            with contextlib.suppress(BlobNotFound):
                out |= Manifest.from_dict(await self.store.get_json(key)).blobs()
        for key in await self.store.list_keys(PAUSED_PREFIX):
            with contextlib.suppress(BlobNotFound):
                out |= _paused_blobs(await self.store.get_json(key))
        for key in await self.store.list_keys(REFS_PREFIX):
            with contextlib.suppress(BlobNotFound):
                raw = await self.store.get_json(key)
                out |= {str(b) for b in raw.get("blobs", [])} if isinstance(raw, dict) else set()
        return out

    async def gc_blobs(self, grace_s: float = GC_GRACE_S) -> list[str]:
        """Deletes the blobs no manifest or ref names and that nobody uploaded, reused or
        marked for `grace_s`; returns their digests. Blobs and marks are listed before the
        manifests (a blob whose manifest is written meanwhile was marked after the listing:
        its mark is read again, fresh, just before the delete); a push whose blob still went
        in the gap finds it missing once its manifest is written, and pushes again."""
        now = time.time()
        blobs = {
            k[len(BLOB_PREFIX) :]: t for k, t in (await self.store.listing(BLOB_PREFIX)).items()
        }
        marks = {
            k[len(MARK_PREFIX) :]: t for k, t in (await self.store.listing(MARK_PREFIX)).items()
        }
        live = await self.referenced_blobs()
        gone: list[str] = []
        for digest, modified in sorted(blobs.items()):
            if digest in live or now - max(modified, marks.get(digest, 0.0)) < grace_s:
                continue
            marked = await self.store.modified_at(mark_key(digest))
            if marked is not None and time.time() - marked < grace_s:
                continue
            await self.store.delete(blob_key(digest))
            await self.store.delete(mark_key(digest))
            gone.append(digest)
        # Marks of blobs that are gone (a delete cut short) go too, once old.
        for digest, modified in marks.items():
            if digest not in blobs and now - modified >= grace_s:
                await self.store.delete(mark_key(digest))
        return gone
