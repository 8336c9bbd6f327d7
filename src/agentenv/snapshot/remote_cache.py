"""The local cache of pulled snapshots (`RemoteCache`): held by `CACHE_HOLDER`, touched on use,
evicted least recently used to the node's limit, and the partial files of dead pulls
cleaned. Split from `remote.py`."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import time
from collections import Counter
from collections.abc import Collection
from pathlib import Path

from agentenv.snapshot.errors import SnapshotError
from agentenv.snapshot.model import Snapshot
from agentenv.snapshot.remote_manifest import Manifest, RemoteSnapshotError
from agentenv.snapshot.remote_transfer import RemoteTransfer, log
from agentenv.snapshot.repository import LAYER_HOLDER
from agentenv.storage.errors import LayerNotFound

# The repository holder of every snapshot a pull brought in: keeps it from `repo.gc`,
# and marks it as a cache entry `evict` may remove when nothing else holds it.
CACHE_HOLDER = "cache:remote"


class RemoteCache(RemoteTransfer):
    """Pulled snapshots as an evictable cache."""

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
