"""VM records: a live QEMU is found by pid and start time, or by its QMP socket path; a
reused pid or a dead process is not mistaken for it."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from agentenv.vmm import registry
from agentenv.vmm.registry import VMRecord


@pytest.fixture
def fake_vm(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """A process whose command line carries a QMP socket argument, as QEMU's does."""
    sock = str(tmp_path / "qmp.sock")
    proc = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)", "-qmp", f"unix:{sock},server=on"]
    )
    try:
        # Until the child has exec'd, its command line is still its parent's (pytest's): on a
        # loaded host the lookups below ran in that window (run 21).
        deadline = time.monotonic() + 30
        cmdline = Path(f"/proc/{proc.pid}/cmdline")
        while sock.encode() not in cmdline.read_bytes():
            assert time.monotonic() < deadline, "the fake VM never exec'd"
            time.sleep(0.01)
        yield proc, sock
    finally:
        proc.kill()
        proc.wait()


def test_write_load_remove_round_trip(tmp_path: Path) -> None:
    rec = VMRecord(name="a", workdir="/w", qmp_socket="/w/qmp.sock", pid=7, starttime=1)
    registry.write(tmp_path, rec)
    (tmp_path / "half.tmp").write_text("{")
    (tmp_path / "junk.json").write_text("not json")
    assert registry.load_all(tmp_path) == [rec]
    # A reader leaves a write in progress alone; the owner's sweep at its start removes it.
    assert (tmp_path / "half.tmp").exists()
    assert registry.load_all(tmp_path, sweep=True) == [rec]
    assert not (tmp_path / "half.tmp").exists()
    registry.remove(tmp_path, "a", pid=8)  # another process's record: kept
    assert registry.load_all(tmp_path) == [rec]
    registry.remove(tmp_path, "a", pid=7)
    assert registry.load_all(tmp_path) == []


def test_a_reader_polling_the_records_does_not_break_a_write(tmp_path: Path) -> None:
    """A test (or any tool) that polls the records while the server writes one: every write
    lands. Readers once removed `.tmp` files, and a write whose file went failed its rename
    (a converter did not start: `No such file or directory: '…-cv.tmp' -> '…-cv.json'`)."""
    stop = threading.Event()

    def poll() -> None:
        while not stop.is_set():
            registry.load_all(tmp_path)

    reader = threading.Thread(target=poll)
    reader.start()
    try:
        for i in range(2000):
            rec = VMRecord(name="w-cv", workdir="/w", qmp_socket="/w/q.sock", pid=i)
            registry.write(tmp_path, rec)
    finally:
        stop.set()
        reader.join()
    assert registry.load_all(tmp_path)[0].pid == 1999


def test_live_pid_by_pid_and_start_time(fake_vm: tuple[subprocess.Popen[bytes], str]) -> None:
    proc, sock = fake_vm
    start = registry.proc_starttime(proc.pid)
    assert start is not None
    rec = VMRecord(name="a", workdir="/w", qmp_socket=sock, pid=proc.pid, starttime=start)
    assert registry.live_pid(rec) == proc.pid
    # The same pid with another start time is another process.
    reused = VMRecord(name="a", workdir="/w", qmp_socket=sock, pid=proc.pid, starttime=start + 1)
    assert registry.live_pid(reused) is None
    # A process whose command line does not name the socket is not this VM.
    other = VMRecord(name="a", workdir="/w", qmp_socket="/elsewhere", pid=proc.pid, starttime=start)
    assert registry.live_pid(other) is None


def test_live_pid_without_pid_is_found_by_socket(
    fake_vm: tuple[subprocess.Popen[bytes], str],
) -> None:
    proc, sock = fake_vm
    rec = VMRecord(name="a", workdir="/w", qmp_socket=sock)
    assert registry.live_pid(rec) == proc.pid
    proc.kill()
    proc.wait()
    assert registry.live_pid(rec) is None


def test_dead_process_is_not_live(tmp_path: Path) -> None:
    proc = subprocess.Popen(["true"])
    proc.wait()
    rec = VMRecord(
        name="a", workdir="/w", qmp_socket=str(tmp_path / "s"), pid=proc.pid, starttime=1
    )
    assert registry.live_pid(rec) is None
