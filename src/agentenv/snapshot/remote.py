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
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import shutil
import time
import weakref
from collections import Counter
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentenv.aio import thread_whole
from agentenv.config import Settings
from agentenv.filelock import file_lock
from agentenv.objstore import ObjectStore, SparseSink, SparseSource
from agentenv.objstore.client import BLOB_PREFIX, MARK_PREFIX, REFS_PREFIX, blob_key, mark_key
from agentenv.objstore.errors import BlobNotFound, ObjectStoreError
from agentenv.snapshot.errors import SnapshotError, SnapshotNotFound
from agentenv.snapshot.model import Snapshot
from agentenv.snapshot.repository import LAYER_HOLDER, MEMORY, STATE, SnapshotRepository
from agentenv.storage import LayerStore, images
from agentenv.storage.errors import LayerNotFound
from agentenv.template.cache import INPUTS_FILE

log = logging.getLogger(__name__)

MANIFEST_PREFIX = "snapshots/"
PAUSED_PREFIX = "paused/"
# A blob nobody references is deleted only when neither it nor its mark changed for this
# long: longer than any push takes between uploading (or reusing) a blob and writing the
# manifest that names it.
GC_GRACE_S = 3600.0
# A push whose blob a collection deleted meanwhile is done again (it uploads what is missing).
PUSH_ATTEMPTS = 3
MANIFEST_VERSION = 1
# The repository holder of every snapshot a pull brought in: keeps it from `repo.gc`,
# and marks it as a cache entry `evict` may remove when nothing else holds it.
CACHE_HOLDER = "cache:remote"
PULL_LOCK_TIMEOUT_S = 3600.0


class RemoteSnapshotError(SnapshotError):
    """A snapshot could not be pushed to or pulled from object storage."""


class IncompletePush(RemoteSnapshotError):
    """A blob the push wrote its manifest for is not in the bucket (a collection took it)."""


def manifest_key(snapshot_id: str) -> str:
    return f"{MANIFEST_PREFIX}{snapshot_id}.json"


def paused_key(sandbox_id: str) -> str:
    return f"{PAUSED_PREFIX}{sandbox_id}.json"


def _paused_blobs(manifest: Any) -> set[str]:
    """The blobs a paused sandbox's manifest (`push_paused`'s) names."""
    if not isinstance(manifest, dict):
        return set()
    out = {str(layer["blob"]) for layer in manifest.get("layers", []) if "blob" in layer}
    out |= {str(f["blob"]) for f in dict(manifest.get("files", {})).values() if "blob" in f}
    return out


@dataclass(frozen=True)
class RemoteLayer:
    digest: str  # the layer's name in every store (and in the snapshot)
    blob: str  # sha256 of the file bytes that were uploaded
    size: int
    backing: str | None  # absolute backing path in the pushing node's store

    def to_dict(self) -> dict[str, Any]:
        return {
            "digest": self.digest,
            "blob": self.blob,
            "size": self.size,
            "backing": self.backing,
        }


@dataclass(frozen=True)
class Manifest:
    """What `snapshots/<id>.json` holds."""

    snapshot: Snapshot
    layers: list[RemoteLayer]
    memory: dict[str, Any] | None  # blob, size (packed), file_size, extents
    state: dict[str, Any] | None  # blob, size
    tools: dict[str, Any] | None  # path, blob, size

    def to_dict(self) -> dict[str, Any]:
        snap = self.snapshot.to_dict()
        # Local bookkeeping of the pushing node, not part of the snapshot.
        for local in ("holders", "deleted"):
            snap.pop(local, None)
        return {
            "version": MANIFEST_VERSION,
            "snapshot": snap,
            "layers": [layer.to_dict() for layer in self.layers],
            "memory": self.memory,
            "state": self.state,
            "tools": self.tools,
        }

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> Manifest:
        if raw.get("version") != MANIFEST_VERSION:
            raise RemoteSnapshotError(f"manifest version {raw.get('version')!r} is not supported")
        try:
            snap = Snapshot.from_dict({**raw["snapshot"], "holders": [], "deleted": False})
            layers = [RemoteLayer(**layer) for layer in raw["layers"]]
        except (KeyError, TypeError) as exc:
            raise RemoteSnapshotError(f"manifest is malformed: {exc}") from exc
        return cls(snap, layers, raw.get("memory"), raw.get("state"), raw.get("tools"))

    def blobs(self) -> set[str]:
        out = {layer.blob for layer in self.layers}
        for part in (self.memory, self.state):
            if part:
                out.add(part["blob"])
        if self.tools:
            out |= {entry["blob"] for entry in self.tools["files"].values()}
        return out


class RemoteSnapshots:
    """Push and pull snapshots between this node's repository and an object store."""

    def __init__(
        self,
        store: ObjectStore,
        repo: SnapshotRepository,
        layers: LayerStore,
        *,
        state_dir: Path,
        cache_limit_bytes: int | None = None,
    ) -> None:
        self.store = store
        self.repo = repo
        self.layers = layers
        # Local copies of manifests of pulled and pushed snapshots; their mtime is the
        # snapshot's last use (LRU for `evict`).
        self.state_dir = state_dir
        self.cache_limit_bytes = cache_limit_bytes
        self._locks: weakref.WeakKeyDictionary[
            asyncio.AbstractEventLoop, dict[str, asyncio.Lock]
        ] = weakref.WeakKeyDictionary()

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

    def _manifest_copy(self, snapshot_id: str) -> Path:
        return self.state_dir / "snapshots" / f"{snapshot_id}.json"

    def _lock(self, snapshot_id: str) -> asyncio.Lock:
        locks = self._locks.setdefault(asyncio.get_running_loop(), {})
        return locks.setdefault(snapshot_id, asyncio.Lock())

    # -- push -------------------------------------------------------------------------------------

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

    async def _check_complete(self, blobs: set[str], what: str) -> None:
        """After the manifest is written: every blob it names is there. A collection that
        decided before the manifest existed may have deleted a blob this push reused; that
        push is then not done (the caller pushes again, which uploads what is missing)."""
        missing = [b for b in sorted(blobs) if await self.store.has_blob(b) is None]
        if missing:
            raise IncompletePush(
                f"{what}: blob {missing[0][:12]} went from {self.store.bucket} while it was "
                "pushed (a concurrent garbage collection); push it again"
            )

    def _keep_manifest(self, manifest: Manifest) -> None:
        path = self._manifest_copy(manifest.snapshot.id)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(manifest.to_dict(), sort_keys=True))
        tmp.chmod(0o600)  # it holds the guest's envd token
        os.replace(tmp, path)

    # -- pull -------------------------------------------------------------------------------------

    async def manifest(self, snapshot_id: str) -> Manifest:
        try:
            raw = await self.store.get_json(manifest_key(snapshot_id))
        except BlobNotFound:
            raise SnapshotNotFound(
                f"snapshot {snapshot_id!r} is neither on this node nor in {self.store.bucket}"
            ) from None
        return Manifest.from_dict(raw)

    async def remote_ids(self) -> list[str]:
        """Ids of every snapshot pushed to the bucket."""
        keys = await self.store.list_keys(MANIFEST_PREFIX)
        return sorted(k[len(MANIFEST_PREFIX) : -len(".json")] for k in keys if k.endswith(".json"))

    async def exists(self, snapshot_id: str) -> bool:
        return await self.store.size_of(manifest_key(snapshot_id)) is not None

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

    async def _pull_layer(self, layer: RemoteLayer) -> None:
        try:
            await asyncio.to_thread(self.layers.path, layer.digest)
            return
        except LayerNotFound:
            pass
        lock = self.state_dir / "locks" / f"layer-{layer.digest}.lock"
        await asyncio.to_thread(lock.parent.mkdir, 0o700, True, True)
        async with file_lock(
            lock,
            name=f"the pull lock of layer {layer.digest[:12]}",
            timeout_s=PULL_LOCK_TIMEOUT_S,
            waiter="a layer pull",
        ):
            final = self.layers.root / f"{layer.digest}.qcow2"
            if await asyncio.to_thread(final.is_file):
                return
            await asyncio.to_thread(self.layers.root.mkdir, 0o755, True, True)
            # Not `*.qcow2`: the store takes every such name for a layer.
            tmp = self.layers.root / f".pull-{layer.digest}.{os.getpid()}.tmp"
            await self.store.get_file(layer.blob, tmp)
            try:
                await asyncio.to_thread(self._place_layer, layer, tmp, final)
            finally:
                await asyncio.to_thread(tmp.unlink, True)

    def _place_layer(self, layer: RemoteLayer, tmp: Path, final: Path) -> None:
        if layer.backing is not None:
            parent_digest = Path(layer.backing).name.removesuffix(".qcow2")
            parent = self.layers.path(parent_digest)  # pulled before it: bottom → top
            if Path(layer.backing) != parent:
                # The pushing node's store lives elsewhere: point at this node's parent.
                images.rebase_unsafe(tmp, parent)
        tmp.chmod(0o444)
        os.replace(tmp, final)

    async def _push_tools(self, path: Path) -> dict[str, Any]:
        """The tools layer, with the rest of its build-cache artifact directory when it is
        one (`template.cache`: `<kind>-<hash>/` with `inputs.json`), so a node that lacks it
        gets a complete artifact, not a bare file in a directory the cache takes as built."""
        files: dict[str, dict[str, Any]] = {}
        folder = path.parent
        if await asyncio.to_thread((folder / INPUTS_FILE).is_file):
            names = sorted(
                p.name
                for p in await asyncio.to_thread(lambda: list(folder.iterdir()))
                if p.is_file()
            )
        else:
            names = [path.name]
        for name in names:
            f = folder / name
            files[name] = {
                "blob": await self.store.put_file(f),
                "size": (await asyncio.to_thread(f.stat)).st_size,
            }
        return {"path": str(path), "files": files, "artifact": len(names) > 1}

    async def _pull_tools(self, tools: dict[str, Any]) -> None:
        path = Path(tools["path"])
        if await asyncio.to_thread(path.is_file):
            return
        folder = path.parent
        lock = self.state_dir / "locks" / f"tools-{folder.name}.lock"
        await asyncio.to_thread(lock.parent.mkdir, 0o700, True, True)
        async with file_lock(lock, name="the tools layer pull lock", timeout_s=PULL_LOCK_TIMEOUT_S):
            if await asyncio.to_thread(path.is_file):
                return
            if not tools.get("artifact"):
                entry = tools["files"][path.name]
                await self.store.get_file(entry["blob"], path, mode=0o444)
                return
            if await asyncio.to_thread(folder.exists):
                raise RemoteSnapshotError(f"{folder} exists but has no {path.name}")
            # As `template.cache` builds: a temporary directory renamed into place whole.
            tmp = folder.with_name(f".tmp-{folder.name}-{os.getpid()}")
            await asyncio.to_thread(shutil.rmtree, tmp, True)
            try:
                for name, entry in tools["files"].items():
                    mode = 0o444 if name == path.name else 0o644
                    await self.store.get_file(entry["blob"], tmp / name, mode=mode)
                try:
                    await asyncio.to_thread(os.rename, tmp, folder)
                except OSError:
                    if not await asyncio.to_thread(path.is_file):
                        raise
            finally:
                await asyncio.to_thread(shutil.rmtree, tmp, True)

    # -- paused sandboxes -----------------------------------------------------------------------

    async def _push_chain(self, top: str) -> list[RemoteLayer]:
        chain = await asyncio.to_thread(self.layers.chain, top)
        out: list[RemoteLayer] = []
        for digest in reversed(chain):  # bottom → top
            path = await asyncio.to_thread(self.layers.path, digest)
            backing = (await asyncio.to_thread(images.info, path)).backing_file
            blob = await self.store.put_file(path)
            size = (await asyncio.to_thread(path.stat)).st_size
            out.append(RemoteLayer(digest, blob, size, None if backing is None else str(backing)))
        return out

    async def push_paused(self, workdir: Path, sandbox_id: str) -> dict[str, Any]:
        """Upload a paused sandbox (its workdir as `snapshot.pause` left it: the record, the
        node's `sandbox.json`, the disk upper, and the RAM the pause saved) with the layers
        under its upper, as ``paused/<sandbox_id>.json`` + blobs. The caller keeps it paused
        (and its stream conversion settled) while this runs. Returns the manifest."""
        for attempt in range(PUSH_ATTEMPTS):
            try:
                return await self._push_paused_once(workdir, sandbox_id)
            except IncompletePush:
                if attempt == PUSH_ATTEMPTS - 1:
                    raise
        raise AssertionError("unreachable")

    async def _push_paused_once(self, workdir: Path, sandbox_id: str) -> dict[str, Any]:
        from agentenv.snapshot.pause import STREAM, paused_state

        rec = await asyncio.to_thread(paused_state, workdir)
        if rec is None:
            raise RemoteSnapshotError(f"sandbox {sandbox_id} is not paused ({workdir})")
        upper = workdir / rec.upper
        backing = (await asyncio.to_thread(images.info, upper)).backing_file
        if backing is None:
            raise RemoteSnapshotError(f"sandbox {sandbox_id}: its upper {upper} has no backing")
        top = backing.name.removesuffix(".qcow2")
        layers = await self._push_chain(top)
        files: dict[str, dict[str, Any]] = {}
        names = ["paused.json", "sandbox.json", rec.upper]
        if rec.kind == "state":
            names.append(STATE)
        elif rec.kind == "stream":
            names.append(STREAM)
        for name in names:
            path = workdir / name
            if not await asyncio.to_thread(path.is_file):
                if name == "sandbox.json":
                    continue
                raise RemoteSnapshotError(f"sandbox {sandbox_id}: {path} is missing")
            files[name] = {
                "blob": await self.store.put_file(path),
                "size": (await asyncio.to_thread(path.stat)).st_size,
            }
        files[rec.upper]["backing"] = str(backing)
        files[rec.upper]["top_layer"] = top
        if rec.kind == "state":
            source = await asyncio.to_thread(SparseSource, workdir / MEMORY)
            try:
                files[MEMORY] = {
                    "blob": await self.store.put_source(source),
                    "size": source.size,
                    "file_size": source.file_size,
                    "extents": [list(e) for e in source.extents],
                }
            finally:
                source.close()
        manifest = {
            "version": MANIFEST_VERSION,
            "sandbox_id": sandbox_id,
            "kind": rec.kind,
            "layers": [layer.to_dict() for layer in layers],
            "files": files,
        }
        await self.store.put_json(paused_key(sandbox_id), manifest)
        await self._check_complete(_paused_blobs(manifest), f"paused sandbox {sandbox_id}")
        return manifest

    async def pull_paused(self, sandbox_id: str, workdir: Path) -> Path:
        """Recreate a pushed paused sandbox at `workdir` (which must not exist) on this node:
        layers first (only the missing ones), then the files in a staging directory beside
        `workdir`, the upper re-pointed at this node's copy of its layer, a layer reference
        for `sandbox_id` on it, and one rename. A failure leaves no `workdir`."""
        try:
            raw = await self.store.get_json(paused_key(sandbox_id))
        except BlobNotFound:
            raise RemoteSnapshotError(
                f"paused sandbox {sandbox_id} is not in {self.store.bucket}"
            ) from None
        if raw.get("version") != MANIFEST_VERSION or raw.get("sandbox_id") != sandbox_id:
            raise RemoteSnapshotError(f"paused sandbox {sandbox_id}: unusable manifest")
        if await asyncio.to_thread(workdir.exists):
            raise RemoteSnapshotError(f"paused sandbox {sandbox_id}: {workdir} exists already")
        for layer in raw["layers"]:
            await self._pull_layer(RemoteLayer(**layer))
        files: dict[str, dict[str, Any]] = raw["files"]
        await asyncio.to_thread(workdir.parent.mkdir, 0o755, True, True)
        # Not in the sandboxes dir: a node's recovery would take it for a lost sandbox.
        staging = self.state_dir / "pulls" / f"{sandbox_id}-{os.getpid()}"
        await asyncio.to_thread(staging.parent.mkdir, 0o700, True, True)
        await asyncio.to_thread(shutil.rmtree, staging, True)
        await asyncio.to_thread(staging.mkdir, 0o700)
        top: str | None = None
        try:
            for name, entry in files.items():
                if name == MEMORY:
                    sink = await asyncio.to_thread(
                        SparseSink, staging / name, int(entry["file_size"]), entry["extents"]
                    )
                    await self.store.get_into(entry["blob"], sink)
                else:
                    await self.store.get_file(entry["blob"], staging / name, mode=0o600)
                if "top_layer" in entry:
                    top = str(entry["top_layer"])
                    here = await asyncio.to_thread(self.layers.path, top)
                    if Path(entry["backing"]) != here:
                        await asyncio.to_thread(images.rebase_unsafe, staging / name, here)
            if top is None:
                raise RemoteSnapshotError(f"paused sandbox {sandbox_id}: no upper in manifest")
            try:
                await thread_whole(self.layers.ref, top, sandbox_id)
                await asyncio.to_thread(os.rename, staging, workdir)
            except BaseException:
                await asyncio.to_thread(self.layers.unref, top, sandbox_id)
                raise
        except BaseException:
            await asyncio.to_thread(shutil.rmtree, staging, True)
            raise
        return workdir

    async def delete(self, snapshot_id: str) -> bool:
        """Drop a snapshot's manifest: no node fetches it from here any more. Its blobs stay
        for any other manifest that names them. False: the bucket had no such snapshot."""
        self._manifest_copy(snapshot_id).unlink(missing_ok=True)
        if not await self.exists(snapshot_id):
            return False
        await self.store.delete(manifest_key(snapshot_id))
        return True

    async def paused_kind(self, sandbox_id: str) -> str | None:
        """The kind of pause (`snapshot.pause`: state, stream or disk) of the sandbox's copy in
        the bucket; None when the bucket has none."""
        try:
            raw = await self.store.get_json(paused_key(sandbox_id))
        except BlobNotFound:
            return None
        kind = raw.get("kind") if isinstance(raw, dict) else None
        return kind if isinstance(kind, str) else None

    async def delete_paused(self, sandbox_id: str) -> None:
        """Drop a paused sandbox's manifest (it resumed somewhere, or was killed); its blobs
        stay for any other manifest that names them."""
        await self.store.delete(paused_key(sandbox_id))

    # -- garbage collection of the bucket --------------------------------------------------------

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

    # -- the local cache of pulled snapshots -----------------------------------------------------

    def touch(self, snapshot_id: str) -> None:
        """Mark a snapshot as just used (its place in `evict`'s LRU order)."""
        now = time.time()
        with contextlib.suppress(FileNotFoundError):
            os.utime(self._manifest_copy(snapshot_id), (now, now))

    def pinned_blobs(self) -> set[str]:
        """Blobs of snapshots on this node that something uses (a holder other than the
        cache, or a name): for a `objstore.BlobCache` of this node."""
        out: set[str] = set()
        snaps = {s.id: s for s in self.repo.list()}
        for path in (self.state_dir / "snapshots").glob("*.json"):
            snap = snaps.get(path.stem)
            if snap is None or not (snap.names or set(snap.holders) - {CACHE_HOLDER}):
                continue
            with contextlib.suppress(OSError, ValueError, RemoteSnapshotError):
                out |= Manifest.from_dict(json.loads(path.read_text())).blobs()
        return out

    def evict(self, limit_bytes: int | None = None, *, keep: Collection[str] = ()) -> list[str]:
        """Delete pulled snapshots nothing but the cache holds (no name, no sandbox, no
        restore under way), least recently used first, until the pulled ones that are left
        take at most `limit_bytes` (default: the cache limit); never those in `keep`.
        Returns the ids deleted."""
        limit = self.cache_limit_bytes if limit_bytes is None else limit_bytes
        if limit is None:
            return []
        entries: list[tuple[float, Snapshot, int]] = []
        total = 0
        present = self.repo.list()
        users = Counter(d for snap in present for d in snap.layers)
        for snap in present:
            if CACHE_HOLDER not in snap.holders:
                continue
            size = snap.memory_bytes + snap.state_bytes + self._own_layer_bytes(snap, users)
            try:
                used = self._manifest_copy(snap.id).stat().st_mtime
            except FileNotFoundError:
                used = snap.created_at
            entries.append((used, snap, size))
            total += size
        removed: list[str] = []
        for _, snap, size in sorted(entries, key=lambda e: e[0]):
            if total <= limit:
                break
            if snap.id in keep:
                continue
            current = self.repo.get(snap.id)
            if current.names or set(current.holders) - {CACHE_HOLDER}:
                continue  # pinned: a template name, a sandbox, a warm entry
            self.repo.unref(snap.id, CACHE_HOLDER)
            try:
                self.repo.delete(snap.id)
            except SnapshotError as exc:
                log.warning("evicting snapshot %s: %s", snap.id, exc)
                continue
            self._manifest_copy(snap.id).unlink(missing_ok=True)
            removed.append(snap.id)
            total -= size
        return removed

    def _own_layer_bytes(self, snap: Snapshot, users: Counter[str]) -> int:
        """Bytes of the snapshot's layers that no other snapshot lists and nothing else holds
        directly: about what deleting it frees (`users`: snapshots per layer)."""
        total = 0
        for digest in snap.layers:
            if users[digest] > 1 or set(self.layers.holders(digest)) - {LAYER_HOLDER + snap.id}:
                continue
            with contextlib.suppress(LayerNotFound, OSError):
                total += self.layers.path(digest).stat().st_size
        return total

    def cleanup_partials(self) -> list[Path]:
        """Remove what pulls whose process died left: downloads (`*.<pid>-<rand>.partial`),
        layers not yet placed (`.pull-<digest>.<pid>.tmp`) and paused-sandbox staging dirs
        (`pulls/<id>-<pid>`). Those of live processes stay (a pull may be under way); the
        repository's own `gc` removes its staging dirs."""
        gone: list[Path] = []
        candidates = [
            *self.layers.root.glob(".pull-*"),
            *self.repo.root.glob(".staging-*/*.partial"),
            *(self.state_dir / "pulls").glob("*"),
        ]
        for path in candidates:
            pid = _writer_pid(path.name)
            if pid is None or _alive(pid):
                continue
            with contextlib.suppress(OSError):
                if path.is_dir():
                    shutil.rmtree(path)
                else:
                    path.unlink()
                gone.append(path)
        return gone


def _writer_pid(name: str) -> int | None:
    """The pid in a partial's name: `x.<pid>-<rand>.partial`, `.pull-<d>.<pid>.tmp`,
    `<id>-<pid>`."""
    for pattern in (r"\.(\d+)-[0-9a-f]+\.partial$", r"\.(\d+)\.tmp$", r"-(\d+)$"):
        if m := re.search(pattern, name):
            return int(m.group(1))
    return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


async def push_snapshot(settings: Settings, store: ObjectStore, ref: str) -> Manifest:
    """`RemoteSnapshots.push` on this node's repository."""
    return await RemoteSnapshots.from_settings(settings, store).push(ref)


async def pull_snapshot(
    settings: Settings,
    store: ObjectStore,
    snapshot_id: str,
    *,
    names: Sequence[str] = (),
    holders: Sequence[str] = (),
) -> Snapshot:
    """`RemoteSnapshots.pull` into this node's repository."""
    return await RemoteSnapshots.from_settings(settings, store).pull(
        snapshot_id, names=names, holders=holders
    )


__all__ = [
    "CACHE_HOLDER",
    "Manifest",
    "ObjectStoreError",
    "RemoteLayer",
    "RemoteSnapshotError",
    "RemoteSnapshots",
    "manifest_key",
    "paused_key",
    "pull_snapshot",
    "push_snapshot",
]
