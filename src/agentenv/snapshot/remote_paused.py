"""A paused sandbox in object storage (`RemotePaused`): its layers, workdir record, upper and
saved RAM pushed under `paused/<id>.json`, pulled back and assembled beside the target
before the rename into place. Split from `remote.py`."""

from __future__ import annotations

import asyncio
import os
import shutil
from pathlib import Path
from typing import Any

from agentenv.aio import thread_whole
from agentenv.files import META, PAUSED, SandboxFiles
from agentenv.objstore import SparseSink, SparseSource
from agentenv.objstore.errors import BlobNotFound
from agentenv.snapshot.remote_manifest import (
    MANIFEST_VERSION,
    PUSH_ATTEMPTS,
    IncompletePush,
    RemoteLayer,
    RemoteSnapshotError,
    _paused_blobs,
    paused_key,
)
from agentenv.snapshot.remote_transfer import RemoteTransfer
from agentenv.snapshot.repository import MEMORY, STATE
from agentenv.storage import images


class RemotePaused(RemoteTransfer):
    """Push and pull of paused sandboxes."""

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
        names = [PAUSED, META, rec.upper]
        if rec.kind == "state":
            names.append(STATE)
        elif rec.kind == "stream":
            names.append(STREAM)
        for name in names:
            path = workdir / name
            if not await asyncio.to_thread(path.is_file):
                if name == META:
                    continue
                raise RemoteSnapshotError(f"sandbox {sandbox_id}: {path} is missing")
            files[name] = {
                "blob": await self.store.put_file(path),
                "size": (await asyncio.to_thread(path.stat)).st_size,
            }
        files[rec.upper]["backing"] = str(backing)
        files[rec.upper]["top_layer"] = top
        if rec.kind == "state":
            source = await asyncio.to_thread(SparseSource, SandboxFiles(workdir).memory)
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
