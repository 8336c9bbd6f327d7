"""The suite's guard against removing big files on the server's event loop.

Unlinking a file gives its blocks back before the call returns: for a RAM stream or a memory
file (hundreds of MB) that is milliseconds of kernel time, and on the event loop every other
request of the server waits through it. `guard_unlinks` records each `os.unlink` (which
`Path.unlink` and `shutil.rmtree` call) of a file holding `BIG` or more that a coroutine of
the project's own code made (directly or through the plain functions it called), not from a
thread; the fixture in conftest fails the test that made one. A test's own plain call on its
loop does not count: only the server's coroutines share a loop with other requests.
"""

from __future__ import annotations

import inspect
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

import pytest

# Allocated size from which an unlink counts: the smallest sandbox's RAM files are hundreds
# of times this, the small files a coroutine may remove (sockets, records) far below.
BIG = 1 << 20
_ASYNC = inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR


def _ours(frame: FrameType) -> bool:
    return "/agentenv/" in frame.f_code.co_filename


def _where(frame: FrameType) -> str:
    return f"{frame.f_code.co_filename.rsplit('/agentenv/', 1)[1]}:{frame.f_lineno}"


def _from_our_coroutine() -> str | None:
    """Where the project's code that led here starts, if a coroutine of it is on the stack;
    None otherwise (a thread, or a test's plain call)."""
    frame: FrameType | None = sys._getframe(2)
    chain: list[str] = []
    while frame is not None:
        if _ours(frame):
            chain.append(f"{_where(frame)} {frame.f_code.co_name}")
            if frame.f_code.co_flags & _ASYNC:
                return " < ".join(chain[:4])
        frame = frame.f_back
    return None


@contextmanager
def guard_unlinks(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Yields the list the unlinks found are put in, as "path: N MiB, from frames"."""
    seen: list[str] = []
    real = os.unlink

    def unlink(path: Any, *, dir_fd: int | None = None) -> None:
        where = _from_our_coroutine()
        if where is not None:
            try:
                held = os.stat(path, dir_fd=dir_fd, follow_symlinks=False).st_blocks * 512
            except OSError:
                held = 0
            if held >= BIG:
                seen.append(f"{os.fsdecode(path)}: {held >> 20} MiB, from {where}")
        real(path, dir_fd=dir_fd)

    monkeypatch.setattr(os, "unlink", unlink)
    yield seen
