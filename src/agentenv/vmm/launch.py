"""The server's side of the VM launcher (`vmm.launcher`): one launcher process per server
process, started on first use and again after it died.

`Launcher.launch` sends a plan (argv, cgroup, network namespace, jail) and the descriptors for
QEMU's stdout/stderr, and gets back QEMU's PID and a pidfd for it. It blocks (a socket round
trip of a few milliseconds, bounded by a deadline): call it off the event loop. Exit statuses
arrive on the same socket as the launcher reaps its children (`exit_status`)."""

from __future__ import annotations

import json
import logging
import os
import select
import socket
import subprocess
import sys
import threading
import time
from typing import Any

from agentenv.vmm import launcher as proc_side
from agentenv.vmm.errors import VMStartError

log = logging.getLogger(__name__)

# A launch is a fork and a few dozen system calls; the child's setup has its own deadline.
LAUNCH_TIMEOUT_S = proc_side.SETUP_TIMEOUT_S + 10.0
# How long a launcher gets to start answering (a Python interpreter without site).
START_TIMEOUT_S = 30.0


class LauncherError(VMStartError):
    """The launcher died or stopped answering (the next launch starts a new one)."""


class Launcher:
    """One launcher process and the socket to it; thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._sock: socket.socket | None = None
        self._owner = 0
        self._seq = 0
        self._exits: dict[int, int] = {}
        # Children of the running launcher not yet reported ended: only their status can come.
        self._children: set[int] = set()

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def _start(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-I", "-S", proc_side.__file__, str(theirs.fileno())],
                pass_fds=[theirs.fileno()],
                stdin=subprocess.DEVNULL,
                # Its own session: a signal to the server's process group leaves it (and the
                # QEMUs it reaps) alone.
                start_new_session=True,
            )
        finally:
            theirs.close()
        self._sock = ours
        self._owner = os.getpid()
        log.info("VM launcher started (pid %d)", self._proc.pid)

    def _dead(self, why: str) -> LauncherError:
        """Forget the launcher (the next launch starts another); the error to raise."""
        proc, sock = self._proc, self._sock
        self._proc = self._sock = None
        self._children.clear()
        if sock is not None:
            sock.close()
        status = "still running"
        if proc is not None:
            try:
                code = proc.wait(timeout=1.0)
                status = f"exit status {code}"
            except subprocess.TimeoutExpired:
                proc.kill()
                status = "killed"
        pid = proc.pid if proc is not None else "?"
        log.error("VM launcher (pid %s) lost: %s (%s)", pid, why, status)
        return LauncherError(
            f"the VM launcher (pid {pid}) {why} ({status}); the next VM start runs a new one"
        )

    def _ensure(self) -> socket.socket:
        if self._sock is not None and self._owner != os.getpid():
            # A forked copy of the server: the launcher is the parent's.
            self._proc = self._sock = None
            self._children.clear()
        if self._proc is not None and self._proc.poll() is not None:
            log.warning("VM launcher (pid %d) had ended (%s); starting another",
                        self._proc.pid, self._proc.returncode)  # fmt: skip
            self._proc = self._sock = None
            self._children.clear()
        if self._sock is None:
            self._start()
        assert self._sock is not None
        return self._sock

    def _read(self, sock: socket.socket, deadline: float) -> tuple[dict[str, Any], list[int]]:
        if not _readable(sock, deadline):
            raise self._dead(f"did not answer in {LAUNCH_TIMEOUT_S:.0f}s")
        try:
            got = proc_side.recv(sock)
        except (OSError, ValueError) as exc:
            raise self._dead(f"broke the channel: {exc}") from exc
        if got is None:
            raise self._dead("ended")
        msg, fds = got
        if "exit" in msg:
            pid = int(msg["exit"])
            self._children.discard(pid)
            self._exits[pid] = int(msg["status"])
        return msg, fds

    def launch(self, plan: dict[str, Any], stdout: int, stderr: int) -> tuple[int, int]:
        """Start the process `plan` describes; (pid, pidfd). Raises VMStartError with the
        child's reason if its setup or exec failed, LauncherError if the launcher failed."""
        with self._lock:
            sock = self._ensure()
            self._seq += 1
            seq = self._seq
            try:
                proc_side.send(sock, {"id": seq, "plan": plan}, [stdout, stderr])
            except OSError as exc:
                raise self._dead(f"refused the request: {exc}") from exc
            deadline = time.monotonic() + LAUNCH_TIMEOUT_S
            while True:
                msg, fds = self._read(sock, deadline)
                if msg.get("id") != seq:
                    for fd in fds:
                        os.close(fd)
                    continue
                if "error" in msg:
                    for fd in fds:
                        os.close(fd)
                    raise VMStartError(f"the launch failed: {msg['error']}")
                if len(fds) != 1:
                    for fd in fds:
                        os.close(fd)
                    raise self._dead(f"answered {msg} with {len(fds)} descriptors")
                pid = int(msg["pid"])
                self._children.add(pid)
                return pid, fds[0]

    def exit_status(self, pid: int, timeout_s: float) -> int | None:
        """The status of a child `pid` of this launcher that has ended, once the launcher has
        reaped it (None if it does not say so in `timeout_s`, or is not its child)."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while True:
                if pid in self._exits:
                    return self._exits.pop(pid)
                if pid not in self._children:
                    # Another (dead) launcher's child: its status is nobody's to tell.
                    return None
                sock = self._sock
                if sock is None or self._owner != os.getpid():
                    return None
                if not _readable(sock, deadline):
                    return None
                try:
                    msg, fds = self._read(sock, deadline)
                except LauncherError:
                    return None
                for fd in fds:
                    os.close(fd)
                if "exit" not in msg:
                    log.warning("VM launcher: unexpected message %s", json.dumps(msg)[:200])


def _readable(sock: socket.socket, deadline: float) -> bool:
    """Whether `sock` has something to read before `deadline` (poll: a server holds more
    descriptors than select() takes)."""
    left = deadline - time.monotonic()
    if left <= 0:
        return False
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    return bool(poller.poll(left * 1000))


_shared = Launcher()


def shared() -> Launcher:
    """This server process's launcher."""
    return _shared
