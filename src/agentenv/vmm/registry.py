"""Which QEMU processes a data dir has running: one JSON record per VM in `<home>/run/vms`.

QEMU runs in a session of its own, so it outlives a server killed with SIGKILL. The record is
how the next server finds it again, by PID *and* the process's start time (a PID alone may
have been reused), or, when the server died between spawn and writing the PID, by the QMP
socket path on the process's command line (unique per VM). Never by process name: several
servers with other data dirs may run QEMUs on the same host.

The record also holds everything the VM was built from (`spec`), so a live VM can be
re-attached (`QemuVM.adopt`) with the same drives, memory file and network namespace.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUFFIX = ".json"


@dataclass
class VMRecord:
    name: str
    workdir: str
    qmp_socket: str
    # None between writing the record and the spawn returning.
    pid: int | None = None
    # Field 22 of /proc/<pid>/stat (clock ticks since boot): tells a reused PID apart.
    starttime: int | None = None
    spec: dict[str, Any] = field(default_factory=dict)
    # The QMP socket path on QEMU's command line. A workdir moved while QEMU runs (a warm
    # entry becoming a sandbox) changes `qmp_socket` but not the command line, and the
    # command line is what tells this QEMU apart from a process that reused its PID.
    launch_socket: str | None = None


def record_path(directory: Path, name: str) -> Path:
    return directory / f"{name}{SUFFIX}"


def write(directory: Path, record: VMRecord) -> None:
    """Atomically (rename), so a reader never sees half a record."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    path = record_path(directory, record.name)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record.__dict__))
    os.replace(tmp, path)


def remove(directory: Path, name: str, pid: int | None = None) -> None:
    """Remove the record of `name`; with `pid`, only if it is that process's (a new QEMU of
    the same sandbox may have written its own since)."""
    path = record_path(directory, name)
    if pid is not None:
        try:
            current = json.loads(path.read_text()).get("pid")
        except (OSError, ValueError):
            current = None
        if current not in (None, pid):
            return
    path.unlink(missing_ok=True)


def load_all(directory: Path, *, sweep: bool = False) -> list[VMRecord]:
    """Every record in `directory`; unreadable ones are skipped. A `.tmp` file is a write in
    progress or what a crash mid-write left. Only the data dir's owner at its start, with no
    writer left, removes them (``sweep``): a reader that did would break the rename of a
    write in progress (a test polling the records did, and a converter failed to start)."""
    out: list[VMRecord] = []
    if not directory.is_dir():
        return out
    for path in sorted(directory.iterdir()):
        if path.suffix == ".tmp":
            if sweep:
                path.unlink(missing_ok=True)
            continue
        if path.suffix != SUFFIX:
            continue
        try:
            raw = json.loads(path.read_text())
            out.append(VMRecord(**raw))
        except (OSError, ValueError, TypeError):
            continue
    return out


def proc_starttime(pid: int) -> int | None:
    """The start time of a live (not zombie) process, None if there is none."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    # fields[0] is the state (field 3); starttime is field 22.
    if fields[0] in ("Z", "X"):
        return None
    return int(fields[19])


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def qemu_processes(mentioning: str) -> dict[int, str]:
    """Live QEMU processes whose command line contains `mentioning` (e.g. a data dir):
    pid → command line. For checks from outside (tests, benches, diagnostics). QEMU itself
    only: the launchers in front of it (a confined VM's `unshare`) carry its argv too."""
    out: dict[int, str] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            cmd = _cmdline(int(entry))
            program = cmd.split(" ", 1)[0]
            if "qemu-system" in program and mentioning in cmd:
                out[int(entry)] = cmd
    return out


def live_pid(record: VMRecord) -> int | None:
    """The PID of the QEMU this record describes if it still runs, else None."""
    marker = f"unix:{record.launch_socket or record.qmp_socket},"
    if record.pid is not None:
        start = proc_starttime(record.pid)
        if start is not None and start == record.starttime and marker in _cmdline(record.pid):
            return record.pid
        if record.starttime is not None:
            return None
    # The server died before it wrote the PID down: look for the socket path.
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(ValueError):
                pid = int(entry)
                if marker in _cmdline(pid) and proc_starttime(pid) is not None:
                    return pid
    return None
