"""A layer blob as an uncompressed stream: compression detected from the first bytes, gzip
and zstd inflated by a `zstd -dc` child (beside the Python that parses the tar) or in
process without the CLI, and the stream hashed on its own thread while it is read
(`HashingReader`: the diffID, progress calls). Split from `unpack.py`, which applies the
entries."""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import queue
import shutil
import subprocess
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, cast

import zstandard

COPY_CHUNK = 1024 * 1024
# Uncompressed bytes between two progress calls.
PROGRESS_EVERY = 4 * 1024 * 1024
ZSTD_BIN = shutil.which("zstd")


class _ShaThread:
    """sha256 in a thread of its own: hashlib lets go of the GIL while it hashes, so the
    diffID is computed on the core the tar parsing is not using. `close` must be called."""

    def __init__(self) -> None:
        self.sha = hashlib.sha256()
        self._chunks: queue.Queue[bytes | None] = queue.Queue(maxsize=8)
        self._thread = threading.Thread(target=self._run, name="layer-sha256", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (data := self._chunks.get()) is not None:
            self.sha.update(data)

    def update(self, data: bytes) -> None:
        self._chunks.put(data)

    def close(self) -> None:
        if self._thread.is_alive():
            self._chunks.put(None)
            self._thread.join()

    def hexdigest(self) -> str:
        self.close()
        return self.sha.hexdigest()


class HashingReader(io.RawIOBase):
    """A read-only stream that hashes (and counts) everything read through it, and reports
    the count every `PROGRESS_EVERY` bytes. `hash=False` only counts (a scan whose diffID is
    checked by the apply that follows)."""

    def __init__(
        self,
        inner: IO[bytes],
        *,
        hash: bool = True,
        progress: Callable[[int], None] | None = None,
    ) -> None:
        self.inner = inner
        self.sha = _ShaThread() if hash else None
        self.count = 0
        self.progress = progress
        self._next_report = PROGRESS_EVERY
        self._reported = -1

    def readable(self) -> bool:
        return True

    def _took(self, data: bytes) -> None:
        if self.sha is not None:
            self.sha.update(data)
        self.count += len(data)
        if self.progress is not None and self.count >= self._next_report:
            self._next_report = self.count + PROGRESS_EVERY
            self._reported = self.count
            self.progress(self.count)

    def readinto(self, buf: memoryview) -> int:  # type: ignore[override]
        data = self.inner.read(len(buf))
        n = len(data)
        buf[:n] = data
        self._took(data)
        return n

    def finish(self) -> str:
        # The archive's end padding counts toward the diffID too.
        while True:
            data = self.inner.read(COPY_CHUNK)
            if not data:
                break
            self._took(data)
        if self.progress is not None and self._reported != self.count:
            self.progress(self.count)
        return "sha256:" + (self.sha.hexdigest() if self.sha is not None else "")

    def close(self) -> None:
        if self.sha is not None:
            self.sha.close()
        super().close()


class DecompressError(Exception):
    """The decompressor child exited with an error (corrupt or truncated data)."""


class _ChildStream(io.RawIOBase):
    """The stdout of the decompressor child; at its end, the child's exit status is checked,
    so a bad checksum or a truncated input fails the read instead of ending it quietly."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdout is not None
        self.proc = proc
        self.out = proc.stdout

    def readable(self) -> bool:
        return True

    def readinto(self, buf: memoryview) -> int:  # type: ignore[override]
        n = self.out.readinto(buf)  # type: ignore[attr-defined]
        if not n:
            code = self.proc.wait()
            if code != 0:
                assert self.proc.stderr is not None
                tail = self.proc.stderr.read().decode(errors="replace").strip()
                raise DecompressError(tail.splitlines()[-1] if tail else f"zstd exit {code}")
        return int(n or 0)


@contextmanager
def _child_decompressor(raw: IO[bytes]) -> Iterator[IO[bytes]]:
    assert ZSTD_BIN is not None
    # The child reads the descriptor itself: from byte 0, whatever Python buffered.
    os.lseek(raw.fileno(), 0, os.SEEK_SET)
    proc = subprocess.Popen(
        [ZSTD_BIN, "-d", "-c", "-q", "--no-progress"],
        stdin=raw,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        yield cast(IO[bytes], io.BufferedReader(_ChildStream(proc), COPY_CHUNK))
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        for pipe in (proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()


@contextmanager
def open_uncompressed(blob: Path) -> Iterator[IO[bytes]]:
    """The blob's tar stream, decompressed according to its magic bytes."""
    with blob.open("rb") as raw:
        head = raw.read(4)
        raw.seek(0)
        compressed = head[:2] == b"\x1f\x8b" or head == b"\x28\xb5\x2f\xfd"
        if compressed and ZSTD_BIN is not None:
            with _child_decompressor(raw) as out:
                yield out
        elif head[:2] == b"\x1f\x8b":
            with gzip.GzipFile(fileobj=raw) as gz:
                yield cast(IO[bytes], gz)
        elif head == b"\x28\xb5\x2f\xfd":
            dctx = zstandard.ZstdDecompressor()
            with dctx.stream_reader(raw, read_across_frames=True) as zs:
                yield cast(IO[bytes], zs)
        else:
            yield raw
