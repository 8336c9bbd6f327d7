"""A node's local copies of blobs, under a size limit.

Entries are ``<root>/sha256/<hex>`` (mode 0444), fetched from the object store on first use
(one download per blob across the node's tasks and processes: a file lock per digest). Every
use sets the entry's mtime to now (`touch`); atime is not trusted, filesystems are mounted
`relatime`/`noatime`. `evict` removes the least recently used entries until the cache fits its
limit, never one that is pinned.

The cache keeps no reference counts of its own. What is pinned is asked of `pins`, a callable
that derives it from the references the node already keeps (the layer store's holders, the
snapshot repository's holders and names: see `snapshot.remote.pinned_blobs`), plus the
entries a caller holds open in this process (`hold`).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Collection
from dataclasses import dataclass
from pathlib import Path

from agentenv.filelock import file_lock
from agentenv.objstore.bucket import blob_key
from agentenv.objstore.client import ObjectStore

PinSource = Callable[[], Collection[str]]
# A `.partial` this old belongs to a download whose process died.
STALE_PARTIAL_S = 3600.0


def no_pins() -> Collection[str]:
    return ()


@dataclass(frozen=True)
class CacheEntry:
    digest: str
    path: Path
    size: int  # bytes on disk
    last_used: float


class BlobCache:
    def __init__(
        self,
        root: Path,
        limit_bytes: int,
        store: ObjectStore | None = None,
        *,
        pins: PinSource = no_pins,
    ) -> None:
        self.root = root
        self.limit_bytes = limit_bytes
        self.store = store
        self.pins = pins
        self._held: Counter[str] = Counter()

    # -- entries ------------------------------------------------------------------------------

    def path(self, digest: str) -> Path:
        blob_key(digest)  # validates the digest
        return self.root / "sha256" / digest

    def has(self, digest: str) -> bool:
        return self.path(digest).is_file()

    def touch(self, digest: str) -> None:
        now = time.time()
        with contextlib.suppress(FileNotFoundError):
            os.utime(self.path(digest), (now, now))

    def entries(self) -> list[CacheEntry]:
        out: list[CacheEntry] = []
        folder = self.root / "sha256"
        if not folder.is_dir():
            return out
        for p in folder.iterdir():
            if len(p.name) != 64:
                continue
            with contextlib.suppress(FileNotFoundError):
                st = p.stat()
                out.append(CacheEntry(p.name, p, st.st_blocks * 512, st.st_mtime))
        return out

    def usage(self) -> int:
        return sum(e.size for e in self.entries())

    # -- fetching -------------------------------------------------------------------------------

    async def fetch(self, digest: str) -> Path:
        """The local path of a blob, downloaded first if missing (then the cache is trimmed
        to its limit, this entry held meanwhile)."""
        path = self.path(digest)
        if path.is_file():
            self.touch(digest)
            return path
        if self.store is None:
            raise FileNotFoundError(f"blob {digest[:12]} is not cached and no store is set")
        lock = self.root / "locks" / f"{digest}.lock"
        lock.parent.mkdir(parents=True, exist_ok=True)
        async with file_lock(
            lock,
            name=f"the download lock of blob {digest[:12]}",
            timeout_s=self.store.call_timeout_s * 4,
            waiter="a blob fetch",
        ):
            if not path.is_file():
                await self.store.get_file(digest, path, mode=0o444)
        self.touch(digest)
        async with self.hold(digest):
            await asyncio.to_thread(self.evict)
        return path

    @contextlib.asynccontextmanager
    async def hold(self, digest: str) -> AsyncIterator[Path]:
        """Pin an entry in this process while the caller uses its path."""
        self._held[digest] += 1
        try:
            yield self.path(digest)
        finally:
            self._held[digest] -= 1
            if self._held[digest] <= 0:
                del self._held[digest]

    # -- eviction -------------------------------------------------------------------------------

    def evict(self, limit_bytes: int | None = None) -> list[str]:
        """Remove least recently used, unpinned entries until the cache uses at most
        `limit_bytes` (default: its limit). Returns the digests removed. Pinned entries stay
        even when they alone exceed the limit."""
        limit = self.limit_bytes if limit_bytes is None else limit_bytes
        self.root.mkdir(parents=True, exist_ok=True)
        removed: list[str] = []
        with (self.root / ".lock").open("a+") as lockfile:
            fcntl.flock(lockfile, fcntl.LOCK_EX)
            entries = sorted(self.entries(), key=lambda e: e.last_used)
            total = sum(e.size for e in entries)
            if total > limit:
                pinned = set(self.pins()) | set(self._held)
                for entry in entries:
                    if total <= limit:
                        break
                    if entry.digest in pinned:
                        continue
                    with contextlib.suppress(FileNotFoundError):
                        entry.path.unlink()
                        removed.append(entry.digest)
                    total -= entry.size
            cutoff = time.time() - STALE_PARTIAL_S
            for partial in (self.root / "sha256").glob("*.partial"):
                with contextlib.suppress(OSError):
                    if partial.stat().st_mtime < cutoff:
                        partial.unlink()
        return removed
