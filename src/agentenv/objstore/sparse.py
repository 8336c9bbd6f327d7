"""Sparse files as blobs: only the data extents travel.

A snapshot's memory file is as large as the guest's RAM but holds data only where the guest
touched it. `SparseSource` finds the data extents (`SEEK_DATA`/`SEEK_HOLE`) and presents their
bytes back to back as the blob; the extent list goes into the manifest that names the blob,
and `SparseSink` writes the stream back at those offsets into a file of the original size, so
the copy has the same holes (and `snapshot.digest.sparse_digest` gives the same value).
"""

from __future__ import annotations

import bisect
import os
import threading
from pathlib import Path
from typing import Any

from agentenv.objstore.source import file_identity, partial_path

Extent = tuple[int, int]  # [start, end) in the file


def data_extents(fd: int, size: int) -> list[Extent]:
    out: list[Extent] = []
    pos = 0
    while pos < size:
        try:
            start = os.lseek(fd, pos, os.SEEK_DATA)
        except OSError:  # ENXIO: only a hole is left
            break
        end = os.lseek(fd, start, os.SEEK_HOLE)
        out.append((start, end))
        pos = end
    return out


class _ExtentMap:
    """Packed stream offset ↔ file offset for a list of extents."""

    def __init__(self, extents: list[Extent]) -> None:
        self.extents = extents
        self.starts: list[int] = []  # packed offset where each extent begins
        total = 0
        for start, end in extents:
            if end <= start:
                raise ValueError(f"empty or inverted extent [{start}, {end})")
            self.starts.append(total)
            total += end - start
        self.packed_size = total

    def pieces(self, offset: int, length: int) -> list[tuple[int, int]]:
        """(file offset, length) pieces covering packed bytes [offset, offset+length)."""
        out: list[tuple[int, int]] = []
        i = bisect.bisect_right(self.starts, offset) - 1
        while length > 0 and 0 <= i < len(self.extents):
            start, end = self.extents[i]
            inner = offset - self.starts[i]
            n = min(length, end - start - inner)
            out.append((start + inner, n))
            offset += n
            length -= n
            i += 1
        return out


class SparseSource:
    """The data extents of a file, as one stream."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        self.file_size = os.fstat(self._fd).st_size
        self.extents = data_extents(self._fd, self.file_size)
        self._map = _ExtentMap(self.extents)

    @property
    def size(self) -> int:
        return self._map.packed_size

    def read_at(self, offset: int, length: int) -> bytes:
        parts = [os.pread(self._fd, n, at) for at, n in self._map.pieces(offset, length)]
        return b"".join(parts)

    def identity(self) -> dict[str, Any]:
        return {"kind": "sparse", **file_identity(self.path, self._fd)}

    def close(self) -> None:
        os.close(self._fd)


class SparseSink:
    """Writes a packed stream back into `<dest>.partial` at its extents; renamed on commit."""

    def __init__(self, dest: Path, file_size: int, extents: list[Extent], mode: int = 0o644):
        self.dest = dest
        self.partial = partial_path(dest)
        self._map = _ExtentMap([(int(a), int(b)) for a, b in extents])
        if self._map.extents and self._map.extents[-1][1] > file_size:
            raise ValueError(f"extents reach past the file size {file_size}")
        dest.parent.mkdir(parents=True, exist_ok=True)
        self._fd: int | None = os.open(
            self.partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, mode
        )
        os.ftruncate(self._fd, file_size)
        self._lock = threading.Lock()
        self._written = 0

    def write(self, data: bytes) -> None:
        with self._lock:
            self._write(data)

    def _write(self, data: bytes) -> None:
        # Under the lock: a download thread that outlives its deadline must not write
        # into a descriptor `discard` closed (and the kernel may have handed out again).
        if self._fd is None:
            raise OSError("the download was discarded")
        view = memoryview(data)
        pieces = self._map.pieces(self._written, len(view))
        if sum(n for _, n in pieces) != len(view):
            raise OSError("the stream is longer than its extents")
        for at, n in pieces:
            os.pwrite(self._fd, view[:n], at)
            view = view[n:]
        self._written += len(data)

    def commit(self) -> None:
        with self._lock:
            self._commit()

    def _commit(self) -> None:
        if self._fd is None:
            raise OSError("the download was discarded")
        if self._written != self._map.packed_size:
            raise OSError(f"stream ended at {self._written} of {self._map.packed_size} bytes")
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
