"""`envd.processes` in this process: when a command ends, and what its end delivers.

Upstream envd reaps the process and then sends its end event; a background child that still
holds the output pipes (`cmd &`) must not keep the command open until its timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import pwd
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from agentenv.guest.envd import processes
from agentenv.guest.envd.output_hub import EndInfo, Output, Subscription
from agentenv.guest.envd.process_table import ProcessTable
from agentenv.guest.envd.processes import ProcessSpec
from agentenv.guest.envd.users import User, lookup_user


@pytest.fixture
def me() -> User:
    return lookup_user(pwd.getpwuid(os.geteuid()).pw_name)


@pytest.fixture
async def table() -> AsyncIterator[ProcessTable]:
    table = ProcessTable()
    yield table
    await table.shutdown()


def sh(script: str, *, stdin: bool = False, pty: bool = False) -> ProcessSpec:
    return ProcessSpec(
        cmd="/bin/sh",
        args=("-c", script),
        envs={},
        cwd=None,
        tag=None,
        stdin=stdin,
        pty_size=(80, 24) if pty else None,
    )


async def collect(sub: Subscription, delay: float = 0) -> tuple[dict[str, bytes], EndInfo]:
    out: dict[str, bytearray] = {"stdout": bytearray(), "stderr": bytearray(), "pty": bytearray()}
    while True:
        item = await sub.queue.get()
        if isinstance(item, EndInfo):
            return {k: bytes(v) for k, v in out.items()}, item
        assert isinstance(item, Output)
        out[item.stream] += item.data
        if delay:
            await asyncio.sleep(delay)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is gone for our purposes.
    with contextlib.suppress(FileNotFoundError):
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    return False


def kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


async def test_end_comes_when_the_process_exits_not_when_its_pipes_close(
    table: ProcessTable, me: User, tmp_path: Path
) -> None:
    started = time.monotonic()
    managed, sub = await table.start(
        sh("sleep 60 & echo $!; echo err >&2"), me, {"PATH": os.defpath}, str(tmp_path), 30
    )
    out, end = await asyncio.wait_for(collect(sub), 10)
    took = time.monotonic() - started
    child = int(out["stdout"])
    try:
        assert (end.exit_code, end.exited, out["stderr"]) == (0, True, b"err\n")
        assert took < processes.EXIT_DRAIN_QUIET + 2, f"the end took {took:.1f}s"
        assert managed.pid not in table.by_pid
        assert alive(child), "the background child must keep running"
        # Its pipes are still read, so it can go on writing; once it is gone they close.
        assert len(table.lingering) == 2
    finally:
        kill(child)
    for _ in range(100):
        if not table.lingering:
            break
        await asyncio.sleep(0.05)
    assert not table.lingering


async def test_a_background_child_can_write_after_the_end(
    table: ProcessTable, me: User, tmp_path: Path
) -> None:
    """The read ends stay open after the end, so the child's writes succeed (no SIGPIPE)."""
    marker = tmp_path / "still-writing"
    script = f"(sleep 1; echo late && touch {marker}; sleep 60) & echo $!"
    _, sub = await table.start(sh(script), me, {"PATH": os.defpath}, str(tmp_path), 30)
    out, end = await asyncio.wait_for(collect(sub), 10)
    child = int(out["stdout"])
    try:
        assert end.exit_code == 0
        for _ in range(100):
            if marker.exists():
                break
            await asyncio.sleep(0.05)
        assert marker.exists(), "the child's write after the end failed"
    finally:
        kill(child)


async def test_what_the_process_left_in_its_pipes_is_delivered_to_a_slow_reader(
    table: ProcessTable, me: User, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Short drain windows: the reader below is far slower than both.
    monkeypatch.setattr(processes, "EXIT_DRAIN_QUIET", 0.02)
    monkeypatch.setattr(processes, "EXIT_DRAIN_MAX", 0.05)
    total = 3_000_000
    script = f"sleep 60 & echo $! >&2; head -c {total} /dev/zero"
    _, sub = await table.start(sh(script), me, {"PATH": os.defpath}, str(tmp_path), 30)
    await asyncio.sleep(0.5)  # the process has written what fits and waits for the pipe
    out, end = await asyncio.wait_for(collect(sub, delay=0.01), 30)
    kill(int(out["stderr"]))
    assert end.exit_code == 0
    assert len(out["stdout"]) == total


async def test_output_that_follows_the_exit_without_a_pause_is_kept(
    table: ProcessTable, me: User, tmp_path: Path
) -> None:
    script = "(sleep 0.1; echo late) & echo early"
    _, sub = await table.start(sh(script), me, {"PATH": os.defpath}, str(tmp_path), 30)
    out, end = await asyncio.wait_for(collect(sub), 10)
    assert (out["stdout"], end.exit_code) == (b"early\nlate\n", 0)


async def test_a_child_that_never_stops_writing_cannot_hold_the_end(
    table: ProcessTable, me: User, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(processes, "EXIT_DRAIN_MAX", 0.5)
    script = "(while :; do echo tick; sleep 0.01; done) & echo $! >&2"
    started = time.monotonic()
    _, sub = await table.start(sh(script), me, {"PATH": os.defpath}, str(tmp_path), 30)
    out, end = await asyncio.wait_for(collect(sub), 10)
    kill(int(out["stderr"]))
    assert end.exit_code == 0
    assert time.monotonic() - started < 3


async def test_a_child_holding_stdin_does_not_hold_the_end(
    table: ProcessTable, me: User, tmp_path: Path
) -> None:
    # Python 3.11's Process.wait() returns only when asyncio's pipes are closed too.
    script = "sleep 60 <&0 & echo $!"
    _, sub = await table.start(sh(script, stdin=True), me, {"PATH": os.defpath}, str(tmp_path), 30)
    out, end = await asyncio.wait_for(collect(sub), 10)
    kill(int(out["stdout"]))
    assert end.exit_code == 0


async def test_pty_session_ends_with_its_shell(
    table: ProcessTable, me: User, tmp_path: Path
) -> None:
    # The child holds the terminal; the session ends with the shell and hangs the child up.
    script = "sleep 60 & echo $!; echo bye"
    _, sub = await table.start(sh(script, pty=True), me, {"PATH": os.defpath}, str(tmp_path), 30)
    out, end = await asyncio.wait_for(collect(sub), 10)
    lines = out["pty"].split()
    child = int(lines[0])
    kill(child)
    assert (lines[-1], end.exit_code) == (b"bye", 0)
    assert not table.lingering


async def test_timeout_still_kills_and_ends(table: ProcessTable, me: User, tmp_path: Path) -> None:
    managed, sub = await table.start(sh("sleep 30"), me, {"PATH": os.defpath}, str(tmp_path), 0.5)
    _, end = await asyncio.wait_for(collect(sub), 10)
    assert managed.deadline_hit
    assert (end.exited, end.status) == (False, "signal: killed")
    assert not table.lingering
