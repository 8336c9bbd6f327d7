"""The single-node store's WAL checkpoints: made by `WalCheckpointer` on a thread of its own,
never by a commit on the event loop (docs/control-plane.md)."""

from __future__ import annotations

import asyncio
import sqlite3
import threading
import time
from pathlib import Path

import pytest

from agentenv.control import sqlite_checkpoint
from agentenv.control.sqlite_checkpoint import WalCheckpointer
from agentenv.control.sqlite_store import SqliteStore
from agentenv.control.store import SandboxRecord

from .test_store import _record


def rec(i: int) -> SandboxRecord:
    return _record(f"sbx{i}")


async def test_commits_do_not_checkpoint_and_the_checkpointer_does_on_its_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "agentenv.db"
    store = SqliteStore(path)
    rounds: list[tuple[str, tuple[int, int, int]]] = []
    checkpoint = WalCheckpointer._checkpoint

    def recorded(self: WalCheckpointer) -> tuple[int, int, int]:
        got = checkpoint(self)
        rounds.append((threading.current_thread().name, got))
        return got

    monkeypatch.setattr(WalCheckpointer, "_checkpoint", recorded)
    try:
        # Twice SQLite's default of a checkpoint per 1000 pages of WAL, and no commit made
        # one: the WAL holds all of it.
        for i in range(700):
            await store.insert(rec(i))
            await store.log(f"sbx{i}", "x" * 4000)
        page = store._db.execute("PRAGMA page_size").fetchone()[0]
        assert (tmp_path / "agentenv.db-wal").stat().st_size > 2000 * page
        assert rounds == []
        store.checkpoints.interval_s = 0.05
        await store.open()
        for _ in range(200):
            if rounds:
                break
            await asyncio.sleep(0.05)
        name, (busy, frames, done) = rounds[0]
        assert name.startswith("sqlite-checkpoint")
        assert busy == 0 and frames > 2000 and done == frames
        assert (await store.get("sbx699")) is not None
    finally:
        await store.close()
    assert {name for name, _ in rounds} == {rounds[0][0]}
    await store.close()  # a second close is a no-op


async def test_a_round_without_writes_makes_no_checkpoint(tmp_path: Path) -> None:
    """An idle server's rounds stay on the loop: no hop to the checkpoint thread until the
    store changes a row again."""
    store = SqliteStore(tmp_path / "agentenv.db")
    store.checkpoints.interval_s = 0.02
    try:
        await store.insert(rec(1))
        await store.open()

        async def rounds_settle() -> int:
            for _ in range(250):
                seen = store.checkpoints.rounds
                await asyncio.sleep(0.1)  # five intervals
                if seen and store.checkpoints.rounds == seen:
                    return seen
            pytest.fail("the checkpoint rounds never settled")

        first = await rounds_settle()
        assert first == 1  # the write before open, once
        await store.log("sbx1", "one more line")
        assert await rounds_settle() == first + 1
    finally:
        await store.close()


async def test_a_checkpoint_a_reader_held_back_is_made_again_without_a_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """PASSIVE leaves the frames a reader still needs: the rounds go on until the WAL is
    copied whole, with no write in between, and then stop."""
    path = tmp_path / "agentenv.db"
    store = SqliteStore(path)
    store.checkpoints.interval_s = 0.02
    results: list[tuple[int, int, int]] = []
    checkpoint = WalCheckpointer._checkpoint

    def recorded(self: WalCheckpointer) -> tuple[int, int, int]:
        results.append(checkpoint(self))
        return results[-1]

    monkeypatch.setattr(WalCheckpointer, "_checkpoint", recorded)
    reader = sqlite3.connect(path, isolation_level=None)
    try:
        reader.execute("BEGIN")
        reader.execute("SELECT count(*) FROM sandboxes").fetchone()  # its snapshot: before
        await store.insert(rec(1))
        await store.open()
        for _ in range(250):
            if len(results) >= 2:
                break
            await asyncio.sleep(0.02)
        assert len(results) >= 2 and all(done < frames for _, frames, done in results)
        reader.execute("COMMIT")
        for _ in range(250):
            seen = len(results)
            await asyncio.sleep(0.2)  # ten intervals
            if len(results) == seen:
                break
        else:
            pytest.fail("the checkpoint rounds never settled")
        _, frames, done = results[-1]
        assert frames > 0 and done == frames
    finally:
        reader.close()
        await store.close()


async def test_a_store_closed_unopened_still_checkpoints_what_it_wrote(tmp_path: Path) -> None:
    path = tmp_path / "agentenv.db"
    store = SqliteStore(path)
    for i in range(50):
        await store.insert(rec(i))
    assert store.checkpoints.rounds == 0
    await store.close()
    assert store.checkpoints.rounds == 1
    reopened = SqliteStore(path)
    try:
        assert len(await reopened.select()) == 50
    finally:
        await reopened.close()


async def test_close_does_not_wait_past_its_deadline_for_a_stuck_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A checkpoint stuck in fsync (a hung disk: nothing real here makes one on demand).
    release = threading.Event()

    def stuck(self: WalCheckpointer) -> tuple[int, int, int]:
        release.wait(30)
        return (0, 0, 0)

    monkeypatch.setattr(WalCheckpointer, "_checkpoint", stuck)
    monkeypatch.setattr(sqlite_checkpoint, "CLOSE_TIMEOUT_S", 0.2)
    store = SqliteStore(tmp_path / "agentenv.db")
    await store.insert(rec(1))
    started = time.monotonic()
    try:
        await store.close()
        assert time.monotonic() - started < 5
    finally:
        release.set()
