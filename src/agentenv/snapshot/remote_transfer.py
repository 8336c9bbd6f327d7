"""Moving one snapshot's pieces (`RemoteTransfer`): a layer chain pushed and a layer pulled,
re-pointed at this node's parent and placed; the tools layer; a manifest read, checked
complete and kept. Split from `remote.py`; snapshots (`remote`), paused sandboxes
(`remote_paused`) and the local cache (`remote_cache`) are built over it."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import weakref
from pathlib import Path
from typing import Any

from agentenv.filelock import file_lock
from agentenv.objstore import ObjectStore
from agentenv.objstore.errors import BlobNotFound
from agentenv.snapshot.errors import SnapshotNotFound
from agentenv.snapshot.remote_manifest import (
    PULL_LOCK_TIMEOUT_S,
    IncompletePush,
    Manifest,
    RemoteLayer,
    RemoteSnapshotError,
    manifest_key,
)
from agentenv.snapshot.repository import SnapshotRepository
from agentenv.storage import LayerStore, images
from agentenv.storage.errors import LayerNotFound
from agentenv.template.cache import INPUTS_FILE

log = logging.getLogger("agentenv.snapshot.remote")


class RemoteTransfer:
    """This node's repository and layer store, the bucket, and the per-piece transfers."""

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

    def _manifest_copy(self, snapshot_id: str) -> Path:
        return self.state_dir / "snapshots" / f"{snapshot_id}.json"

    def _lock(self, snapshot_id: str) -> asyncio.Lock:
        locks = self._locks.setdefault(asyncio.get_running_loop(), {})
        return locks.setdefault(snapshot_id, asyncio.Lock())

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

    async def manifest(self, snapshot_id: str) -> Manifest:
        try:
            raw = await self.store.get_json(manifest_key(snapshot_id))
        except BlobNotFound:
            raise SnapshotNotFound(
                f"snapshot {snapshot_id!r} is neither on this node nor in {self.store.bucket}"
            ) from None
        return Manifest.from_dict(raw)

    async def exists(self, snapshot_id: str) -> bool:
        return await self.store.size_of(manifest_key(snapshot_id)) is not None

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
