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

_SUFFIX = ".qcow2"
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
    """Layers under `root`: `<digest>.qcow2` (mode 0444) plus `refs.json`."""

    def __init__(self, root: Path) -> None:
        self.root = root

    # -- locking and the refs file -----------------------------------------------------------

    @contextlib.contextmanager
    def _locked(self) -> Iterator[dict[str, list[str]]]:
        """Hold the store lock and yield the refs table; changes are written back on exit."""
        self.root.mkdir(parents=True, exist_ok=True)
        with (self.root / _LOCK).open("a+") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            refs_path = self.root / _REFS
            refs: dict[str, list[str]] = {}
            if refs_path.exists():
                refs = json.loads(refs_path.read_text() or "{}")
            before = json.dumps(refs, sort_keys=True)
            yield refs
            after = {d: sorted(set(h)) for d, h in refs.items() if h}
            if json.dumps(after, sort_keys=True) != before:
                tmp = refs_path.with_suffix(".tmp")
                tmp.write_text(json.dumps(after, sort_keys=True, indent=1))
                os.replace(tmp, refs_path)

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
        with self._locked() as refs:
            return list(refs.get(digest, []))

    def all_holders(self) -> set[str]:
        """Every holder of any layer (one read of the refs)."""
        with self._locked() as refs:
            return {h for held in refs.values() for h in held}

    def held_by(self, holder: str) -> list[str]:
        """Digests `holder` references (one read of the refs)."""
        with self._locked() as refs:
            return sorted(d for d, held in refs.items() if holder in held)

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
        self.path(digest)
        with self._locked() as refs:
            held = refs.setdefault(digest, [])
            if holder not in held:
                held.append(holder)

    def unref(self, digest: str, holder: str) -> None:
        with self._locked() as refs:
            held = refs.get(digest, [])
            if holder in held:
                held.remove(holder)

    def unref_holder(self, holder: str) -> list[str]:
        """Drop every reference `holder` has (used when a sandbox is torn down); return the
        digests it held."""
        with self._locked() as refs:
            dropped = []
            for digest, held in refs.items():
                if holder in held:
                    held.remove(holder)
                    dropped.append(digest)
            return sorted(dropped)

    def release(self, holder: str) -> list[str]:
        """`unref_holder`, in the same pass returning the digests it held that nothing
        references now (the layers a kill may remove)."""
        with self._locked() as refs:
            freed = []
            for digest, held in refs.items():
                if holder in held:
                    held.remove(holder)
                    if not held:
                        freed.append(digest)
            return sorted(freed)

    def unheld(self, digests: list[str]) -> list[str]:
        """Those of `digests` nothing references now (one read of the refs)."""
        with self._locked() as refs:
            return [d for d in digests if not refs.get(d)]

    # -- removal --------------------------------------------------------------------------------

    def _protected(self, refs: dict[str, list[str]]) -> set[str]:
        keep: set[str] = set()
        for digest, held in refs.items():
            if held and (self.root / f"{digest}{_SUFFIX}").exists():
                keep.update(self.chain(digest))
        return keep

    def remove(self, digest: str) -> None:
        """Delete one layer; refuses if it or anything above it is referenced."""
        p = self.path(digest)
        with self._locked() as refs:
            if digest in self._protected(refs):
                raise LayerInUse(f"layer {digest[:12]} is still referenced")
            for other in self.digests():
                if other != digest and self.parent(other) == digest:
                    raise LayerInUse(f"layer {digest[:12]} backs layer {other[:12]}")
            p.unlink()

    def gc(self) -> list[str]:
        """Remove every layer nothing references, top layers first; return what was removed."""
        removed: list[str] = []
        with self._locked() as refs:
            keep = self._protected(refs)
            while True:
                present = set(self.digests())
                parents = {p for d in present if (p := self.parent(d)) is not None}
                victims = sorted(present - keep - parents)
                if not victims:
                    break
                for d in victims:
                    (self.root / f"{d}{_SUFFIX}").unlink()
                    removed.append(d)
            for stale in self.root.glob(f".add-*{_SUFFIX}"):
                stale.unlink(missing_ok=True)
        return removed
