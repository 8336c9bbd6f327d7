"""Cross-process file locks that wait in asyncio, never in an executor thread.

`file_lock(path, name=..., timeout_s=...)` holds `flock(LOCK_EX)` on `path` for the body of an
``async with``. Coroutines of one process queue on an `asyncio.Lock` per path (and event
loop); only the one at the front tries the file, with ``LOCK_NB`` retried after short
asyncio sleeps (5 ms doubling to 100 ms). So a holder that awaits `asyncio.to_thread` work
while holding never finds the default executor full of threads blocked on its own lock, which
a blocking ``flock`` in `to_thread` per waiter did (eight concurrent creates deadlocked a
2-core host, whose default executor has six threads).

Waiting ends at a deadline with `LockTimeout`, whose message names the lock and the waiter:
``a create: waited 360s for the template build lock of base.1c.512m (...), held by pid 42``.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import weakref
from collections.abc import AsyncIterator
from pathlib import Path

FIRST_RETRY_S = 0.005
MAX_RETRY_S = 0.1

# One asyncio.Lock per lock file and event loop: an asyncio.Lock belongs to the loop that
# first waited on it, and tests (and `asyncio.run` callers) run several loops in turn.
_local: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[str, asyncio.Lock]] = (
    weakref.WeakKeyDictionary()
)


class LockTimeout(TimeoutError):
    """A file lock was not acquired before its deadline."""

    def __init__(self, message: str, *, path: Path, name: str, waited_s: float) -> None:
        super().__init__(message)
        self.path = path
        self.name = name
        self.waited_s = waited_s


def _local_lock(path: Path) -> asyncio.Lock:
    locks = _local.setdefault(asyncio.get_running_loop(), {})
    key = os.path.abspath(path)
    lock = locks.get(key)
    if lock is None:
        lock = locks[key] = asyncio.Lock()
    return lock


def holders(path: Path) -> list[int]:
    """Pids holding an flock on `path` (from /proc/locks; empty when unknown)."""
    try:
        st = os.stat(path)
        text = Path("/proc/locks").read_text()
    except OSError:
        return []
    inode = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    found = []
    for line in text.splitlines():
        parts = line.split()
        # "1: FLOCK  ADVISORY  WRITE 1234 00:2a:5678 0 EOF"; waiters have "->" after the id.
        if len(parts) >= 6 and parts[1] == "FLOCK" and parts[5] == inode and parts[4].isdigit():
            found.append(int(parts[4]))
    return found


@contextlib.asynccontextmanager
async def file_lock(
    path: Path, *, name: str, timeout_s: float, waiter: str | None = None
) -> AsyncIterator[None]:
    """Hold an exclusive flock on `path` (created 0600 if missing) for the body.

    `name` says what the lock guards ("the host network lock"), `waiter` who waits for it
    ("a create of base"); both go into the `LockTimeout` raised after `timeout_s`."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    deadline = start + timeout_s

    def timed_out(where: str) -> LockTimeout:
        waited = loop.time() - start
        who = f"{waiter}: " if waiter else ""
        msg = f"{who}waited {waited:.0f}s for {name} ({path}), {where}"
        return LockTimeout(msg, path=path, name=name, waited_s=waited)

    local = _local_lock(path)
    try:
        async with asyncio.timeout_at(deadline):
            await local.acquire()
    except TimeoutError:
        raise timed_out("held by another task of this process") from None
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            delay = FIRST_RETRY_S
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    pass
                left = deadline - loop.time()
                if left <= 0:
                    pids = [p for p in holders(path) if p != os.getpid()]
                    raise timed_out(
                        f"held by pid {', '.join(map(str, pids))}" if pids else "held elsewhere"
                    )
                await asyncio.sleep(min(delay, left))
                delay = min(delay * 2, MAX_RETRY_S)
            yield
        finally:
            # Closing the only descriptor of this open file releases the flock.
            os.close(fd)
    finally:
        local.release()
