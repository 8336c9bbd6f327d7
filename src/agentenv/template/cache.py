"""A build cache of artifact directories named by a hash of everything that went into them.

An artifact is built in a private temporary directory and renamed into place only once it is
complete, so a directory with the final name is always a finished build; a crashed or
interrupted build leaves only a temporary directory, which the next build of the same key
removes. A per-key lock file keeps two processes from building the same thing at once.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

INPUTS_FILE = "inputs.json"
BUILD_FILE = "build.json"


def digest_files(*paths: Path) -> str:
    """sha256 over the names and contents of files (directories are walked in sorted order)."""
    h = hashlib.sha256()
    for root in paths:
        files = sorted(p for p in root.rglob("*") if p.is_file()) if root.is_dir() else [root]
        for f in files:
            if "__pycache__" in f.parts:
                continue
            h.update(str(f.relative_to(root.parent)).encode() + b"\0")
            h.update(f.read_bytes())
            h.update(b"\0")
    return h.hexdigest()


def input_key(inputs: Mapping[str, str]) -> str:
    blob = json.dumps(dict(inputs), sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


class ArtifactCache:
    """Directories under ``root`` named ``<kind>-<hash of inputs>``."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def path_for(self, kind: str, inputs: Mapping[str, str]) -> Path:
        return self.root / f"{kind}-{input_key(inputs)}"

    def lookup(self, kind: str, inputs: Mapping[str, str]) -> Path | None:
        final = self.path_for(kind, inputs)
        return final if final.is_dir() else None

    def ensure(
        self,
        kind: str,
        inputs: Mapping[str, str],
        build: Callable[[Path], None],
    ) -> tuple[Path, bool]:
        """Return (artifact dir, built?) — building it with ``build(tmpdir)`` on a miss."""
        final = self.path_for(kind, inputs)
        if final.is_dir():
            return final, False
        self.root.mkdir(parents=True, exist_ok=True)
        with self._lock(final.name):
            if final.is_dir():  # another process finished it while we waited
                return final, False
            for stale in self.root.glob(f".tmp-{final.name}-*"):
                shutil.rmtree(stale, ignore_errors=True)
            tmp = self.root / f".tmp-{final.name}-{os.getpid()}"
            tmp.mkdir()
            started = time.time()
            try:
                build(tmp)
                (tmp / INPUTS_FILE).write_text(json.dumps(dict(inputs), indent=2, sort_keys=True))
                info = {"built_at": time.time(), "build_seconds": round(time.time() - started, 2)}
                (tmp / BUILD_FILE).write_text(json.dumps(info))
                _fsync_tree(tmp)
                os.rename(tmp, final)
                _fsync_dir(self.root)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
        return final, True

    @staticmethod
    def build_info(path: Path) -> dict[str, float]:
        """When and how long an artifact took to build (empty if not recorded)."""
        try:
            raw = json.loads((path / BUILD_FILE).read_text())
        except (OSError, ValueError):
            return {}
        return {k: float(v) for k, v in raw.items()}

    def prune(self, keep: set[Path], min_age_s: float = 3600.0) -> list[Path]:
        """Delete finished artifacts not in ``keep`` that were built over ``min_age_s`` ago.

        The age guard spares artifacts another process has just built and may be about to
        use; a QEMU that still has a deleted image open keeps reading it regardless.
        """
        removed: list[Path] = []
        if not self.root.is_dir():
            return removed
        keep_resolved = {k.resolve() for k in keep}
        now = time.time()
        for entry in sorted(self.root.iterdir()):
            if entry.name.startswith(".") or not (entry / INPUTS_FILE).is_file():
                continue
            if entry.resolve() in keep_resolved:
                continue
            if now - (entry / INPUTS_FILE).stat().st_mtime < min_age_s:
                continue
            with self._lock(entry.name):
                shutil.rmtree(entry, ignore_errors=True)
            (self.root / f".{entry.name}.lock").unlink(missing_ok=True)
            removed.append(entry)
        return removed

    @contextmanager
    def _lock(self, name: str) -> Iterator[None]:
        lock_path = self.root / f".{name}.lock"
        with open(lock_path, "a+") as fh:
            fcntl.flock(fh, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(fh, fcntl.LOCK_UN)


def _fsync_tree(root: Path) -> None:
    # Data must be on disk before the rename makes the artifact visible as finished.
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            path = os.path.join(dirpath, name)
            if os.path.islink(path):
                continue
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
