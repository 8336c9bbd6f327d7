"""The processes envd runs (`ProcessTable`): start one (checks, spawn, PTY, supervision),
find it by pid or tag, forget it once it ended, and end them all at shutdown. Split from
`processes.py`, which holds one process's life."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Mapping

from .errors import InvalidArgument, NotFound, PermissionDenied
from .output_hub import Stream, Subscription
from .processes import (
    ManagedProcess,
    ProcessSpec,
    cwd_problem,
    log,
    set_winsize,
    spawn,
    take_controlling_tty,
)
from .users import User


class ProcessTable:
    """Every running process envd started, by pid and by tag."""

    def __init__(self) -> None:
        self.by_pid: dict[int, ManagedProcess] = {}
        # Output readers of ended commands whose pipes a background child still holds.
        self.lingering: set[asyncio.Task[None]] = set()

    def find(self, pid: int | None = None, tag: str | None = None) -> ManagedProcess:
        if pid is not None:
            found = self.by_pid.get(pid)
            if found is None:
                raise NotFound(f"process with pid {pid} not found")
            return found
        if tag is not None:
            for candidate in self.by_pid.values():
                if candidate.spec.tag == tag:
                    return candidate
            raise NotFound(f"process with tag {tag!r} not found")
        raise InvalidArgument("process selector needs a pid or a tag")

    async def start(
        self,
        spec: ProcessSpec,
        user: User,
        env: Mapping[str, str],
        cwd: str,
        timeout_s: float | None,
    ) -> tuple[ManagedProcess, Subscription]:
        if not spec.cmd:
            raise InvalidArgument("process.cmd is empty")
        if (problem := cwd_problem(cwd)) is not None:
            raise InvalidArgument(problem)
        if spec.tag is not None and any(p.spec.tag == spec.tag for p in self.by_pid.values()):
            raise InvalidArgument(f"a process with tag {spec.tag!r} is already running")
        creds: dict[str, object] = {}
        if os.geteuid() == 0:
            creds = {"user": user.uid, "group": user.gid, "extra_groups": list(user.groups)}
        elif os.geteuid() != user.uid:
            raise PermissionDenied(f"envd is not root and cannot run processes as {user.name}")
        outputs: dict[Stream, int] = {}
        try:
            if spec.pty_size is not None:
                master_fd, slave_fd = os.openpty()
                outputs["pty"] = master_fd
                try:
                    cols, rows = spec.pty_size
                    set_winsize(slave_fd, cols or 80, rows or 24)
                    proc, protocol = await spawn(
                        spec.cmd,
                        *spec.args,
                        stdin=slave_fd,
                        stdout=slave_fd,
                        stderr=slave_fd,
                        cwd=cwd,
                        env=dict(env),
                        start_new_session=True,
                        preexec_fn=take_controlling_tty,
                        **creds,
                    )
                finally:
                    os.close(slave_fd)
            else:
                # Our own pipes rather than asyncio's: envd decides when the output is over.
                write_ends: list[int] = []
                try:
                    for stream in ("stdout", "stderr"):
                        read_end, write_end = os.pipe2(os.O_CLOEXEC)
                        outputs[stream] = read_end
                        write_ends.append(write_end)
                    proc, protocol = await spawn(
                        spec.cmd,
                        *spec.args,
                        stdin=asyncio.subprocess.PIPE if spec.stdin else asyncio.subprocess.DEVNULL,
                        stdout=write_ends[0],
                        stderr=write_ends[1],
                        cwd=cwd,
                        env=dict(env),
                        start_new_session=True,
                        **creds,
                    )
                finally:
                    for write_end in write_ends:
                        os.close(write_end)
        except BaseException as exc:
            for fd in outputs.values():
                os.close(fd)
            if isinstance(exc, OSError):
                raise InvalidArgument(
                    f"error starting process {spec.cmd!r}: {exc.strerror or exc}"
                ) from None
            raise
        for fd in outputs.values():
            os.set_blocking(fd, False)
        managed = ManagedProcess(spec, proc, protocol.exited, outputs, time.time())
        self.by_pid[managed.pid] = managed
        first = managed.hub.subscribe()
        managed.start_io(self._forget, timeout_s)
        # Arguments only at debug level: envd's log reaches the serial console, and command
        # lines often carry secrets.
        log.info("started pid %d as %s: %s", managed.pid, user.name, spec.cmd)
        log.debug("pid %d args: %s", managed.pid, list(spec.args))
        return managed, first

    def _forget(self, managed: ManagedProcess) -> None:
        if self.by_pid.get(managed.pid) is managed:
            del self.by_pid[managed.pid]
        for task in managed.lingering:
            self.lingering.add(task)
            task.add_done_callback(self._lingering_done)

    def _lingering_done(self, task: asyncio.Task[None]) -> None:
        self.lingering.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None:
            log.warning("output reader of an ended process failed: %s", exc)

    async def shutdown(self) -> None:
        for managed in list(self.by_pid.values()):
            with contextlib.suppress(Exception):
                managed.signal(signal.SIGKILL)
        for managed in list(self.by_pid.values()):
            with contextlib.suppress(Exception):
                await asyncio.wait_for(managed.done.wait(), 5)
        for task in list(self.lingering):
            task.cancel()
        await asyncio.gather(*self.lingering, return_exceptions=True)
