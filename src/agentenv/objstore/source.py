"""What an upload reads from and a download writes to.

A blob is a byte stream of known size. Most blobs are a file's bytes (`FileSource`,
`FileSink`); a snapshot's memory file is mostly holes, so `sparse.SparseSource` presents only
its data extents as the stream and `sparse.SparseSink` writes them back at their offsets.
"""

from __future__ import annotations

import os
import secrets
import threading
from pathlib import Path
from typing import Any, Protocol


class BlobSource(Protocol):
    """A byte stream of fixed size that can be read at any offset (from threads)."""

    @property
    def size(self) -> int: ...

    def read_at(self, offset: int, length: int) -> bytes: ...

    def identity(self) -> dict[str, Any]:
        """What says this is still the same content (path, inode, size, mtime): an
        interrupted upload of the same identity resumes without hashing again."""
        ...

    def close(self) -> None: ...


class BlobSink(Protocol):
    """Where a download goes: written in order, then either committed or discarded."""

    def write(self, data: bytes) -> None: ...

    def commit(self) -> None:
        """Make what was written visible under its final name."""
        ...

    def discard(self) -> None:
        """Remove whatever was written; nothing is left behind."""
        ...


def partial_path(dest: Path) -> Path:
    """Where a download to `dest` is written first: `<dest>.<pid>-<random>.partial`, unique,
    so concurrent downloads of one blob never share a file; `*.partial` is always safe to
    remove once its writer is gone."""
    return dest.with_name(f"{dest.name}.{os.getpid()}-{secrets.token_hex(4)}.partial")


def file_identity(path: Path, fd: int) -> dict[str, Any]:
    st = os.fstat(fd)
    return {
        "path": str(path.resolve()),
        "dev": st.st_dev,
        "ino": st.st_ino,
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
    }


class FileSource:
    """A regular file's bytes."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        self._size = os.fstat(self._fd).st_size

    @property
    def size(self) -> int:
        return self._size

    def read_at(self, offset: int, length: int) -> bytes:
        return os.pread(self._fd, length, offset)

    def identity(self) -> dict[str, Any]:
        return {"kind": "file", **file_identity(self.path, self._fd)}

    def close(self) -> None:
        os.close(self._fd)


class FileSink:
    """Writes `<dest>.partial`, renamed to `dest` on commit (so `dest` is always complete)."""

    def __init__(self, dest: Path, mode: int = 0o644) -> None:
        self.dest = dest
        self.partial = partial_path(dest)
        dest.parent.mkdir(parents=True, exist_ok=True)
        self._fd: int | None = os.open(
            self.partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, mode
        )
        self._lock = threading.Lock()

    def write(self, data: bytes) -> None:
        with self._lock:
            self._write(data)

    def _write(self, data: bytes) -> None:
        # Under the lock: a download thread that outlives its deadline must not write
        # into a descriptor `discard` closed (and the kernel may have handed out again).
        if self._fd is None:
            raise OSError("the download was discarded")
        view = memoryview(data)
        while view:
            n = os.write(self._fd, view)
            view = view[n:]

    def commit(self) -> None:
        with self._lock:
            self._commit()

    def _commit(self) -> None:
        if self._fd is None:
            raise OSError("the download was discarded")
        os.fsync(self._fd)
        os.close(self._fd)
        self._fd = None
        os.replace(self.partial, self.dest)

    def discard(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
        self.partial.unlink(missing_ok=True)
