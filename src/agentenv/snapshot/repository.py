"""The snapshot repository: immutable, content-addressed snapshots on local disk.

Layout under `root` (``<home>/snapshots``): ``<id>/memory`` (the RAM image, mode 0444),
``<id>/state`` (QEMU device state), ``catalog.json`` (every snapshot's metadata and names),
rewritten atomically under ``.lock``, and ``.holds/<id>/<holder>`` (who maps or keeps each
snapshot: `storage.holds`; a take or drop touches one file, not the catalog). Disk layers
live in the `LayerStore`, held there as ``snapshot:<id>``.

A capture writes into a staging directory (`stage`) and `commit` turns it into a snapshot:
the id is the hash of the device state, the memory file's data and the layer digests, so the
same capture committed twice is one snapshot.
"""

from __future__ import annotations

import builtins
import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

from agentenv.snapshot.digest import allocated_bytes, file_digest, sparse_digest
from agentenv.snapshot.errors import (
    InvalidSnapshotName,
    SnapshotError,
    SnapshotNotFound,
)
from agentenv.snapshot.model import Snapshot
from agentenv.storage import LayerStore
from agentenv.storage.errors import LayerInUse, LayerNotFound
from agentenv.storage.holds import HOLDS_DIR, Holds
from agentenv.template.catalog import validate_name
from agentenv.template.errors import CatalogError

MEMORY = "memory"
STATE = "state"
CATALOG = "catalog.json"
LAYER_HOLDER = "snapshot:"
_STAGING_PREFIX = ".staging-"
STALE_STAGING_S = 3600.0


class SnapshotStore(Protocol):
    """What the orchestrator needs from wherever snapshots live (local disk now; an object
    store can implement it by fetching `memory`/`state` into a local cache on `memory_path`)."""

    def stage(self) -> Path: ...

    def discard(self, staging: Path) -> None: ...

    def commit(self, staging: Path, draft: Snapshot) -> Snapshot: ...

    def adopt(self, draft: Snapshot, memory: Path, state: Path) -> Snapshot | None: ...

    def get(self, ref: str) -> Snapshot: ...

    def list(self) -> list[Snapshot]: ...

    def memory_path(self, snapshot_id: str) -> Path: ...

    def state_path(self, snapshot_id: str) -> Path: ...

    def add_name(self, snapshot_id: str, name: str) -> Snapshot: ...

    def remove_name(self, name: str) -> Snapshot: ...

    def ref(self, snapshot_id: str, holder: str) -> None: ...

    def unref(self, snapshot_id: str, holder: str) -> None: ...

    def unref_holder(self, holder: str) -> None: ...

    def release(self, holder: str) -> builtins.list[str]: ...

    def delete(self, ref: str) -> Snapshot: ...

    def gc(self) -> builtins.list[str]: ...


def check_name(name: str) -> str:
    try:
        return validate_name(name)
    except CatalogError as exc:
        raise InvalidSnapshotName(str(exc)) from None


def snapshot_id(draft: Snapshot, memory: Path, state: Path) -> str:
    """A snapshot's id: the hash of its device state, its memory file's data and its shape
    (layer digests, vCPUs, memory, tools disk); for a filesystem-only draft, its shape."""
    if draft.memory:
        h = hashlib.sha256(b"agentenv-snapshot-v1\0")
        h.update(file_digest(state).encode())
        h.update(sparse_digest(memory).encode())
    else:
        h = hashlib.sha256(b"agentenv-snapshot-disk-v1\0")
    shape = [draft.layers, draft.vcpus, draft.memory_mb, draft.tools_image]
    h.update(json.dumps(shape).encode())
    return h.hexdigest()[:32]


class SnapshotRepository:
    def __init__(self, root: Path, layers: LayerStore) -> None:
        self.root = root
        self.layers = layers
        self.holds = Holds(root / HOLDS_DIR)

    # -- catalog ----------------------------------------------------------------------------

    def _read(self) -> dict[str, Snapshot]:
        try:
            text = (self.root / CATALOG).read_text()
        except FileNotFoundError:
            return {}
        if not text.strip():
            return {}
        try:
            return {e["id"]: Snapshot.from_dict(e) for e in json.loads(text)["snapshots"]}
        except (ValueError, KeyError, TypeError) as exc:
            path = self.root / CATALOG
            raise SnapshotError(f"snapshot catalog {path} is corrupt: {exc}") from exc

    @contextlib.contextmanager
    def _locked(self) -> Iterator[dict[str, Snapshot]]:
        self.root.mkdir(parents=True, exist_ok=True)
        with (self.root / ".lock").open("a+") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            snaps = self._read()
            before = json.dumps([s.to_dict() for s in snaps.values()])
            # A catalog written before `Holds` lists holders in its entries: they become
            # holds, and the rewrite below drops them from the catalog.
            for snap in snaps.values():
                for holder in snap.holders:
                    self.holds.add(snap.id, holder)
                snap.holders = []
            yield snaps
            listed = [s.to_dict() for s in snaps.values()]
            if json.dumps(listed) == before:
                # Nothing changed: no rewrite (a kill's unref and gc found nothing to drop in
                # the usual case, and each rewrite was a temp file, a write and an fsync).
                return
            doc = {"version": 1, "snapshots": listed}
            fd, tmp = tempfile.mkstemp(prefix=".catalog-", dir=self.root)
            try:
                with os.fdopen(fd, "w") as fh:
                    json.dump(doc, fh, indent=1)
                    fh.flush()
                    os.fsync(fh.fileno())
                # It holds envd tokens of captured guests.
                os.chmod(tmp, 0o600)
                os.replace(tmp, self.root / CATALOG)
            except BaseException:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)
                raise

    @staticmethod
    def _find(snaps: dict[str, Snapshot], ref: str) -> Snapshot:
        if ref in snaps and not snaps[ref].deleted:
            return snaps[ref]
        for snap in snaps.values():
            if ref in snap.names and not snap.deleted:
                return snap
        raise SnapshotNotFound(f"snapshot {ref!r} does not exist")

    # -- queries ----------------------------------------------------------------------------

    def _with_holders(self, snap: Snapshot) -> Snapshot:
        # Holders of a catalog not yet migrated (see `_locked`) count too.
        snap.holders = sorted({*snap.holders, *self.holds.holders(snap.id)})
        return snap

    def get(self, ref: str) -> Snapshot:
        return self._with_holders(self._find(self._read(), ref))

    def list(self) -> list[Snapshot]:
        return sorted(
            (self._with_holders(s) for s in self._read().values() if not s.deleted),
            key=lambda s: s.created_at,
        )

    def memory_path(self, snapshot_id: str) -> Path:
        return self.root / snapshot_id / MEMORY

    def state_path(self, snapshot_id: str) -> Path:
        return self.root / snapshot_id / STATE

    # -- adding -----------------------------------------------------------------------------

    def stage(self) -> Path:
        """An empty directory on the repository's filesystem, for a capture to write into
        (`memory`, `state`); moving a guest's memory file into it is a rename."""
        self.root.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix=_STAGING_PREFIX, dir=self.root))

    def discard(self, staging: Path) -> None:
        shutil.rmtree(staging, ignore_errors=True)

    def commit(self, staging: Path, draft: Snapshot) -> Snapshot:
        """Make the staged `memory` + `state` (none for `draft.memory=False`) a snapshot with
        `draft`'s metadata (its `id` and sizes are filled in here; its names and holders are
        taken in the same step, so `gc` never sees it unclaimed). The staging directory is
        consumed."""
        memory, state = staging / MEMORY, staging / STATE
        # A filesystem-only snapshot is its layers alone (no RAM image, no device state).
        files = (memory, state) if draft.memory else ()
        for f in files:
            if not f.is_file():
                raise SnapshotError(f"staged snapshot {staging} has no {f.name}")
        for name in draft.names:
            check_name(name)
        for digest in draft.layers:
            self.layers.path(digest)
        snap_id = snapshot_id(draft, memory, state)
        for f in files:
            f.chmod(0o444)
        final = self.root / snap_id
        with self._locked() as snaps:
            existing = snaps.get(snap_id)
            if existing is not None and existing.deleted:
                existing.deleted = False
            if existing is None:
                if final.exists():  # left by a commit that died before the catalog write
                    shutil.rmtree(final)
                snap = Snapshot.from_dict(
                    {
                        **draft.to_dict(),
                        "id": snap_id,
                        "names": [],
                        "holders": [],
                        "memory_bytes": allocated_bytes(memory) if draft.memory else 0,
                        "state_bytes": state.stat().st_size if draft.memory else 0,
                    }
                )
                for digest in snap.layers[-1:]:
                    self.layers.ref(digest, LAYER_HOLDER + snap_id)
                os.rename(staging, final)
                final.chmod(0o755)
                snaps[snap_id] = snap
            else:
                snap = existing
                shutil.rmtree(staging, ignore_errors=True)
            for holder in draft.holders:
                self.holds.add(snap_id, holder)
            for name in draft.names:
                self._move_name(snaps, snap_id, name)
        return self._with_holders(Snapshot.from_dict(snap.to_dict()))

    def adopt(self, draft: Snapshot, memory: Path, state: Path) -> Snapshot | None:
        """The snapshot that committing `memory` + `state` (files anywhere, not staged) with
        `draft` would make, if it exists already: `draft`'s holders take it (as `commit`
        would), and nothing is copied. None if there is none (then stage and `commit`)."""
        snap_id = snapshot_id(draft, memory, state)
        with self._locked() as snaps:
            snap = snaps.get(snap_id)
            if snap is None or not (self.root / snap_id).is_dir():
                return None
            snap.deleted = False
            for holder in draft.holders:
                self.holds.add(snap_id, holder)
        return self._with_holders(Snapshot.from_dict(snap.to_dict()))

    # -- names and holders --------------------------------------------------------------------

    @staticmethod
    def _move_name(snaps: dict[str, Snapshot], snapshot_id: str, name: str) -> None:
        """A name points at one snapshot; naming another one moves it (like a tag)."""
        for other in snaps.values():
            if name in other.names:
                other.names.remove(name)
        snaps[snapshot_id].names.append(name)

    def add_name(self, snapshot_id: str, name: str) -> Snapshot:
        check_name(name)
        with self._locked() as snaps:
            snap = self._find(snaps, snapshot_id)
            self._move_name(snaps, snap.id, name)
            return snap

    def remove_name(self, name: str) -> Snapshot:
        with self._locked() as snaps:
            for snap in snaps.values():
                if name in snap.names:
                    snap.names.remove(name)
                    return snap
        raise SnapshotNotFound(f"snapshot {name!r} does not exist")

    def ref(self, snapshot_id: str, holder: str) -> None:
        with self._locked() as snaps:
            snap = self._find(snaps, snapshot_id)
            self.holds.add(snap.id, holder)

    def unref(self, snapshot_id: str, holder: str) -> None:
        with self._locked():
            self.holds.drop(snapshot_id, holder)

    def all_holders(self) -> set[str]:
        """Every holder of any snapshot."""
        legacy = {h for snap in self._read().values() for h in snap.holders}
        return legacy | self.holds.all_holders()

    def unref_holder(self, holder: str) -> None:
        with self._locked():
            self.holds.release(holder)

    # -- removal ------------------------------------------------------------------------------

    def delete(self, ref: str) -> Snapshot:
        """Remove a snapshot (by id or name) and the layers only it held. While sandboxes map
        its memory it only disappears from view; `gc` removes it after the last one."""
        with self._locked() as snaps:
            snap = self._find(snaps, ref)
            if self.holds.held(snap.id):
                snap.names = []
                snap.deleted = True
                return self._with_holders(Snapshot.from_dict(snap.to_dict()))
            del snaps[snap.id]
        self._remove_files(snap)
        return snap

    def _remove_files(self, snap: Snapshot) -> None:
        shutil.rmtree(self.root / snap.id, ignore_errors=True)
        self.holds.forget(snap.id)
        self.layers.unref_holder(LAYER_HOLDER + snap.id)
        # Layers a capture added and nothing else holds; stop at the first one still in use
        # (a template's base layer, another snapshot's chain).
        for digest in reversed(snap.layers):
            try:
                self.layers.remove(digest)
            except (LayerInUse, LayerNotFound):
                break

    def release(self, holder: str) -> builtins.list[str]:
        """`unref_holder` and the snapshots that leaves with neither names nor holders
        deleted (a fork's capture with its last child), in one pass over the catalog: a
        kill's step. Returns the deleted ids."""
        with self._locked() as snaps:
            self.holds.release(holder)
            victims = self._unclaimed(snaps)
            for snap in victims:
                del snaps[snap.id]
        for snap in victims:
            self._remove_files(snap)
        return [s.id for s in victims]

    def _unclaimed(self, snaps: dict[str, Snapshot]) -> builtins.list[Snapshot]:
        return [s for s in snaps.values() if not s.names and not self.holds.held(s.id)]

    def gc(self) -> builtins.list[str]:
        """Delete snapshots with neither names nor holders, and leftover staging dirs."""
        with self._locked() as snaps:
            victims = self._unclaimed(snaps)
            for snap in victims:
                del snaps[snap.id]
            # Holds of a snapshot the catalog does not list: a commit that died before its
            # catalog write had taken them.
            strays = [t for t in self.holds.targets() if t not in snaps]
        for snap in victims:
            self._remove_files(snap)
        for target in strays:
            self.holds.forget(target)
        # A staging dir that old belongs to a capture that died; younger ones may be live.
        cutoff = time.time() - STALE_STAGING_S
        for stale in self.root.glob(_STAGING_PREFIX + "*"):
            with contextlib.suppress(OSError):
                if stale.stat().st_mtime < cutoff:
                    shutil.rmtree(stale, ignore_errors=True)
        return [s.id for s in victims]
