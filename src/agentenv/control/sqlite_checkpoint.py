"""WAL checkpoints of the single-node SQLite store, off the event loop.

The store's connection belongs to the server's event loop, and by default SQLite checkpoints
from the connection whose commit filled the WAL (1000 pages): it copies the pages into the
database and fsyncs both files inside that commit, so the loop (every request and proxied
byte) waited through it. An fsync waits for whatever else the filesystem has to write first,
and a pause writes a RAM stream of hundreds of MB. So the store turns automatic checkpoints
off and `WalCheckpointer` makes them from a connection of its own, on a thread of its own,
every `INTERVAL_S`. PASSIVE mode never blocks the store's writers: it copies what no reader
still needs and leaves the rest for the next one. A round in which the store changed no row
skips the checkpoint (`changes`, read on the loop): its hop to the thread and back was a
third of an idle server's wakeups.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sqlite3
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

log = logging.getLogger(__name__)

INTERVAL_S = 1.0
# A checkpoint waits this long for a lock before giving up until the next round.
BUSY_TIMEOUT_MS = 1000
# `close` waits this long for the last checkpoint (an fsync of a stuck disk has no bound of
# its own); what it leaves in the WAL, SQLite's next open recovers.
CLOSE_TIMEOUT_S = 10.0


class WalCheckpointer:
    """Checkpoints the WAL of the database at `path` while `start()`ed, until `close()`."""

    def __init__(
        self,
        path: Path,
        interval_s: float = INTERVAL_S,
        changes: Callable[[], int] | None = None,
    ) -> None:
        self.path = path
        self.interval_s = interval_s
        self.rounds = 0
        # Rows the store's connection has changed so far (`sqlite3.Connection.total_changes`);
        # None: checkpoint every round.
        self._changes = changes
        self._checkpointed_at: int | None = None
        # One thread: a checkpoint stuck in fsync holds it, never a thread of the loop's
        # default executor that requests need.
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="sqlite-checkpoint")
        self._db: sqlite3.Connection | None = None
        self._task: asyncio.Task[None] | None = None
        self._closed = False

    def start(self) -> None:
        """Begin the rounds on the running loop; once (not again after `close`)."""
        if self._task is None and not self._closed:
            self._task = asyncio.get_running_loop().create_task(self._rounds())

    async def checkpoint(self) -> tuple[int, int, int]:
        """One checkpoint now: SQLite's (busy, frames in the WAL, frames checkpointed)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._thread, self._checkpoint)

    def _checkpoint(self) -> tuple[int, int, int]:
        if self._db is None:
            self._db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
            self._db.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
        busy, frames, done = self._db.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
        self.rounds += 1
        return int(busy), int(frames), int(done)

    async def _rounds(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            # Read before the checkpoint: a write during it is caught by the next round.
            changes = None if self._changes is None else self._changes()
            if changes is not None and changes == self._checkpointed_at:
                continue
            try:
                busy, frames, done = await self.checkpoint()
                # Only a checkpoint that copied the whole WAL ends the rounds until the next
                # write: PASSIVE leaves what a reader still needs for a later round.
                if busy == 0 and done == frames:
                    self._checkpointed_at = changes
            except sqlite3.Error as exc:
                log.warning(
                    "checkpoint of %s failed (next in %.0fs): %s", self.path, self.interval_s, exc
                )

    async def close(self) -> None:
        """Stop the rounds, make a last checkpoint and close the connection. Once."""
        if self._closed:
            return
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(CLOSE_TIMEOUT_S):
                with contextlib.suppress(sqlite3.Error):
                    await self.checkpoint()
                await loop.run_in_executor(self._thread, self._close_db)
        except TimeoutError:
            log.warning(
                "the last checkpoint of %s did not end in %.0fs; the next open recovers its WAL",
                self.path,
                CLOSE_TIMEOUT_S,
            )
        self._thread.shutdown(wait=False)

    def _close_db(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None
