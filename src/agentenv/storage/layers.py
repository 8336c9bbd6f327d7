"""Content-addressed, read-only disk layers with persistent reference counts.

A layer is a qcow2 file named by the sha256 of its bytes. A layer that has a backing file
points at its parent by the parent's absolute path inside the store, so a chain resolves
without any lookup table. Holders (templates, sandboxes) take references; a layer with any
reference is never deleted, and a layer that another stored layer backs is never deleted.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from agentenv.storage import images
from agentenv.storage.errors import LayerInUse, LayerNotFound, StorageError
from agentenv.storage.holds import HOLDS_DIR, Holds

_SUFFIX = ".qcow2"
# Before `Holds`: every hold in one table (read once, then turned into files).
_REFS = "refs.json"
_LOCK = ".lock"


def _sha256(path: Path) -> str:
    with path.open("rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


def _check_digest(digest: str) -> str:
    if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
        raise LayerNotFound(f"{digest!r} is not a layer digest")
    return digest


class LayerStore:
    """Layers under `root`: `<digest>.qcow2` (mode 0444) plus their holds (`.holds/`)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.holds = Holds(root / HOLDS_DIR)

    # -- locking and the holds ------------------------------------------------------------------

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """Hold the store lock: a hold taken and a layer removed never cross."""
        self.root.mkdir(parents=True, exist_ok=True)
        with (self.root / _LOCK).open("a+") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            self._migrate()
            yield

    def _migrate(self) -> None:
        """Holds of a store written before `Holds` (one `refs.json` table) become files;
        the table goes once all of them are there, so a crash in between repeats this."""
        legacy = self.root / _REFS
        if not legacy.exists():
            return
        refs: dict[str, list[str]] = json.loads(legacy.read_text() or "{}")
        for digest, held in refs.items():
            for holder in held:
                self.holds.add(digest, holder)
        legacy.unlink()

    # -- queries --------------------------------------------------------------------------------

    def path(self, digest: str) -> Path:
        p = self.root / f"{_check_digest(digest)}{_SUFFIX}"
        if not p.is_file():
            raise LayerNotFound(f"layer {digest[:12]} is not in the store")
        return p

    def digests(self) -> list[str]:
        if not self.root.is_dir():
            return []
        return sorted(p.name[: -len(_SUFFIX)] for p in self.root.glob(f"*{_SUFFIX}"))

    def holders(self, digest: str) -> list[str]:
        with self._locked():
            return self.holds.holders(digest)

    def all_holders(self) -> set[str]:
        """Every holder of any layer."""
        with self._locked():
            return self.holds.all_holders()

    def held_by(self, holder: str) -> list[str]:
        """Digests `holder` references."""
        with self._locked():
            return self.holds.held_by(holder)

    def parent(self, digest: str) -> str | None:
        backing = images.info(self.path(digest)).backing_file
        return None if backing is None else self._digest_of_store_path(backing)

    def chain(self, digest: str) -> list[str]:
        """Digests from `digest` down to the bottom layer."""
        out = [digest]
        while (p := self.parent(out[-1])) is not None:
            out.append(p)
        return out

    def _digest_of_store_path(self, path: Path) -> str:
        if path.parent.resolve() != self.root.resolve() or not path.name.endswith(_SUFFIX):
            raise StorageError(f"layer backing file {path} is outside the store")
        return path.name[: -len(_SUFFIX)]

    # -- adding ---------------------------------------------------------------------------------

    def add(self, src: Path) -> str:
        """Copy an image into the store and return its digest (idempotent).

        Raw images are converted to qcow2. A qcow2 with a backing file has that file added
        first (recursively), then is re-pointed at the stored copy before hashing, so equal
        content over equal parents always gets the same digest.
        """
        src_info = images.info(src)
        self.root.mkdir(parents=True, exist_ok=True)
        parent_path: Path | None = None
        if src_info.backing_file is not None:
            bf = src_info.backing_file
            if bf.parent.resolve() == self.root.resolve() and bf.is_file():
                parent_path = bf
            else:
                parent_path = self.path(self.add(bf))
        fd, tmp_name = tempfile.mkstemp(prefix=".add-", suffix=_SUFFIX, dir=self.root)
        os.close(fd)
        tmp = Path(tmp_name)
        try:
            if src_info.format == "qcow2":
                shutil.copyfile(src, tmp)
            elif src_info.backing_file is None:
                tmp.unlink()
                images.convert_to_qcow2(src, tmp)
            else:
                raise StorageError(f"{src}: a {src_info.format} image with a backing file")
            if parent_path is not None and src_info.backing_file != parent_path:
                images.rebase_unsafe(tmp, parent_path)
            digest = _sha256(tmp)
            final = self.root / f"{digest}{_SUFFIX}"
            with self._locked():
                if final.exists():
                    tmp.unlink()
                else:
                    tmp.chmod(0o444)
                    os.replace(tmp, final)
            return digest
        finally:
            tmp.unlink(missing_ok=True)

    # -- references -----------------------------------------------------------------------------

    def ref(self, digest: str, holder: str) -> None:
        """Record that `holder` uses `digest` (and so, implicitly, its whole chain)."""
        with self._locked():
            self.path(digest)
            self.holds.add(digest, holder)

    def unref(self, digest: str, holder: str) -> None:
        with self._locked():
            self.holds.drop(digest, holder)

    def unref_holder(self, holder: str) -> list[str]:
        """Drop every reference `holder` has (used when a sandbox is torn down); return the
        digests it held."""
        with self._locked():
            return self.holds.release(holder)

    def release(self, holder: str) -> list[str]:
        """`unref_holder`, returning the digests it held that nothing references now (the
        layers a kill may remove)."""
        with self._locked():
            return [d for d in self.holds.release(holder) if not self.holds.held(d)]

    def unheld(self, digests: list[str]) -> list[str]:
        """Those of `digests` nothing references now."""
        with self._locked():
            return [d for d in digests if not self.holds.held(d)]

    # -- removal --------------------------------------------------------------------------------

    def _protected(self) -> set[str]:
        keep: set[str] = set()
        for digest in self.holds.targets():
            if (self.root / f"{digest}{_SUFFIX}").exists():
                keep.update(self.chain(digest))
        return keep

    def remove(self, digest: str) -> None:
        """Delete one layer; refuses if it or anything above it is referenced."""
        p = self.path(digest)
        with self._locked():
            if digest in self._protected():
                raise LayerInUse(f"layer {digest[:12]} is still referenced")
            for other in self.digests():
                if other != digest and self.parent(other) == digest:
                    raise LayerInUse(f"layer {digest[:12]} backs layer {other[:12]}")
            p.unlink()
            self.holds.forget(digest)

    def gc(self) -> list[str]:
        """Remove every layer nothing references, top layers first; return what was removed."""
        removed: list[str] = []
        with self._locked():
            keep = self._protected()
            while True:
                present = set(self.digests())
                parents = {p for d in present if (p := self.parent(d)) is not None}
                victims = sorted(present - keep - parents)
                if not victims:
                    break
                for d in victims:
                    (self.root / f"{d}{_SUFFIX}").unlink()
                    self.holds.forget(d)
                    removed.append(d)
            for stale in self.root.glob(f".add-*{_SUFFIX}"):
                stale.unlink(missing_ok=True)
        return removed
