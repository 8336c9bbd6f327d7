"""Processes started through envd: spawning, output fan-out, stdin, PTY, signals, deadlines.

A process lives independently of the streams that watch it: Start and Connect only subscribe to
its output, so a client that disconnects leaves it running. Each subscriber has a bounded queue
and the readers wait for every subscriber, so a slow client slows the process down (its pipe
fills) instead of growing envd's memory. With no subscriber the output is dropped.

A command ends when its process exits, not when its output pipes reach EOF: `cmd &` leaves a
child holding them open. After the exit, what the process left in its pipes is always delivered,
then output keeps flowing until it pauses (`EXIT_DRAIN_QUIET`) or `EXIT_DRAIN_MAX` has passed,
then the end event goes out. The pipes stay open and are read (and dropped) until the last
holder closes them, so a background server that logs to them keeps working. (Upstream envd's
handler.Wait waits for the pipes' EOF before it reaps, so there `server &` without
`background=True` lasts until the command's timeout.)

The output fan-out is `output_hub`; the table of running processes is `process_table`.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import logging
import os
import signal
import struct
import termios
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from .errors import FailedPrecondition, InvalidArgument, NotFound
from .output_hub import EndInfo, Output, OutputHub, Stream

log = logging.getLogger("agentenv.envd")

# Upstream envd reads 32 KiB at a time. Reading up to 256 KiB costs no latency (a read returns
# what is there) but batches output when the client is the bottleneck, which matters when
# every message's JSON and base64 runs under CPU emulation.
PIPE_CHUNK = 256 * 1024
PTY_CHUNK = 16 * 1024
# After the process exits, output still in flight is drained; if nothing arrives for this long
# the pipes are held by a background child and the stream ends without waiting for it.
EXIT_DRAIN_QUIET = 0.3
# A background child that keeps writing cannot hold the end back longer than this (once what
# the process itself left in the pipes has been delivered).
EXIT_DRAIN_MAX = 2.0
_DRAIN_POLL = 0.05


@dataclass(frozen=True)
class ProcessSpec:
    cmd: str
    args: tuple[str, ...]
    envs: Mapping[str, str]
    cwd: str | None
    tag: str | None
    stdin: bool
    pty_size: tuple[int, int] | None  # (cols, rows)


def describe_status(returncode: int) -> EndInfo:
    """Exit description in the words Go's os.ProcessState uses (what the SDK has always seen)."""
    if returncode >= 0:
        text = f"exit status {returncode}"
        return EndInfo(returncode, True, text, text if returncode else None)
    signum = -returncode
    try:
        name = (signal.strsignal(signum) or f"signal {signum}").lower()
    except ValueError:
        name = f"signal {signum}"
    text = f"signal: {name}"
    return EndInfo(-1, False, text, text)


def cwd_problem(cwd: str) -> str | None:
    # Upstream's words (handler.New) when it is missing; InvalidArgument either way.
    if not os.path.exists(cwd):
        return f"cwd '{cwd}' does not exist"
    if not os.path.isdir(cwd):
        return f"cwd '{cwd}' is not a directory"
    return None


def set_winsize(fd: int, cols: int, rows: int) -> None:
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))


def take_controlling_tty() -> None:
    # Runs in the child after setsid(): stdin is the PTY slave; make it the controlling
    # terminal so job control and `tty`/`stty` behave as in a real login.
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


def _unread_bytes(fd: int) -> int:
    """Bytes waiting to be read on a pipe or terminal (FIONREAD)."""
    try:
        raw = fcntl.ioctl(fd, termios.FIONREAD, b"\0\0\0\0")
    except OSError:
        return 0
    return int(struct.unpack("i", raw)[0])


class _ExitProtocol(asyncio.subprocess.SubprocessStreamProtocol):
    """Tells when the process has exited, whoever still holds its pipes.

    Python 3.11's `Process.wait()` returns only once every pipe asyncio made for the child is
    closed too; envd must not depend on that.
    """

    def __init__(self, limit: int, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(limit=limit, loop=loop)
        self.exited: asyncio.Future[None] = loop.create_future()

    def process_exited(self) -> None:
        super().process_exited()
        if not self.exited.done():
            self.exited.set_result(None)


async def spawn(
    program: str, *args: str, **kwargs: object
) -> tuple[asyncio.subprocess.Process, _ExitProtocol]:
    loop = asyncio.get_running_loop()
    transport, protocol = await loop.subprocess_exec(
        lambda: _ExitProtocol(limit=PIPE_CHUNK, loop=loop),
        program,
        *args,
        **kwargs,  # type: ignore[arg-type]
    )
    return asyncio.subprocess.Process(transport, protocol, loop), protocol


@dataclass
class _Reader:
    stream: Stream
    fd: int
    task: asyncio.Task[None] | None = None
    read: int = 0


class ManagedProcess:
    def __init__(
        self,
        spec: ProcessSpec,
        proc: asyncio.subprocess.Process,
        exited: asyncio.Future[None],
        outputs: Mapping[Stream, int],
        started: float,
    ) -> None:
        """`outputs`: the read ends this process writes to (its pipes, or its PTY master)."""
        self.spec = spec
        self.proc = proc
        self.pid = proc.pid
        self.master_fd = outputs.get("pty")
        self.started = started
        self.hub = OutputHub()
        self.done = asyncio.Event()
        self.deadline_hit = False
        self._exited = exited
        self._readers = [_Reader(stream, fd) for stream, fd in outputs.items()]
        # Pipe readers still draining after the end (a background child holds the pipes).
        self.lingering: list[asyncio.Task[None]] = []
        self._last_output = time.monotonic()
        self._publishing = 0
        self._deadline: asyncio.TimerHandle | None = None
        self._master_writer_fd: int | None = None
        self._supervisor: asyncio.Task[None] | None = None

    def start_io(self, on_exit: Callable[[ManagedProcess], None], timeout_s: float | None) -> None:
        loop = asyncio.get_running_loop()
        for reader in self._readers:
            reader.task = asyncio.create_task(self._pump(reader))
        if timeout_s is not None and timeout_s > 0:
            self._deadline = loop.call_later(timeout_s, self._on_deadline)
        self._supervisor = asyncio.create_task(self._supervise(on_exit))

    def _on_deadline(self) -> None:
        if self.proc.returncode is None:
            self.deadline_hit = True
            self.signal(signal.SIGKILL)

    async def _publish(self, stream: Stream, data: bytes) -> None:
        self._last_output = time.monotonic()
        self._publishing += 1
        try:
            await self.hub.publish(Output(stream, data))
        finally:
            self._publishing -= 1
            self._last_output = time.monotonic()

    async def _pump(self, reader: _Reader) -> None:
        try:
            await self._read_fd(reader)
        finally:
            # A pipe's read end belongs to its reader; the PTY master is closed with the process.
            if reader.stream != "pty":
                os.close(reader.fd)

    async def _read_fd(self, reader: _Reader) -> None:
        loop = asyncio.get_running_loop()
        fd = reader.fd
        chunk = PTY_CHUNK if reader.stream == "pty" else PIPE_CHUNK
        readable = asyncio.Event()
        loop.add_reader(fd, readable.set)
        try:
            while True:
                await readable.wait()
                readable.clear()
                try:
                    data = os.read(fd, chunk)
                except BlockingIOError:
                    continue
                except OSError as exc:
                    # EIO: every slave fd is closed, the terminal is gone.
                    if exc.errno == errno.EIO:
                        return
                    raise
                if not data:
                    return
                reader.read += len(data)
                # Stop watching while a slow subscriber holds us up, so the loop doesn't spin.
                loop.remove_reader(fd)
                try:
                    await self._publish(reader.stream, data)
                finally:
                    loop.add_reader(fd, readable.set)
                readable.set()
        finally:
            loop.remove_reader(fd)

    def _pending_readers(self) -> list[_Reader]:
        return [r for r in self._readers if r.task is not None and not r.task.done()]

    async def _drain_after_exit(self) -> None:
        """Delivers what the exited process left behind, then what follows without a pause.

        Returns at once when the pipes reach EOF (no other holder); else once they have been
        quiet for EXIT_DRAIN_QUIET since the exit or the last output, or after EXIT_DRAIN_MAX.
        """
        exited_at = time.monotonic()
        # A reader that is not done still owns its fd, so FIONREAD asks the right file.
        owed = {id(r): r.read + _unread_bytes(r.fd) for r in self._pending_readers()}
        while pending := self._pending_readers():
            now = time.monotonic()
            delivered = all(r.read >= owed.get(id(r), 0) for r in pending)
            if delivered and self._publishing == 0:
                quiet = now - max(self._last_output, exited_at) >= EXIT_DRAIN_QUIET
                if quiet or now - exited_at >= EXIT_DRAIN_MAX:
                    return
            tasks = [r.task for r in pending if r.task is not None]
            await asyncio.wait(tasks, timeout=_DRAIN_POLL)

    async def _supervise(self, on_exit: Callable[[ManagedProcess], None]) -> None:
        await self._exited
        returncode = self.proc.returncode
        assert returncode is not None
        if self._deadline is not None:
            self._deadline.cancel()
        await self._drain_after_exit()
        for reader in self._pending_readers():
            assert reader.task is not None
            if reader.stream == "pty":
                # The session is over: closing the terminal hangs up whatever still holds it.
                reader.task.cancel()
                await asyncio.gather(reader.task, return_exceptions=True)
            else:
                # Output from here on has no subscriber and is dropped; the holder can still
                # write, so a background server that logs to its stdout keeps working.
                self.lingering.append(reader.task)
        for reader in self._readers:
            task = reader.task
            if (
                task is not None
                and task.done()
                and not task.cancelled()
                and (exc := task.exception()) is not None
            ):
                log.warning("pid %d: output reader failed: %s", self.pid, exc)
        self._close_fds()
        self.hub.finish(describe_status(returncode))
        self.done.set()
        on_exit(self)

    def _close_fds(self) -> None:
        for fd in (self.master_fd, self._master_writer_fd):
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self.master_fd = None
        self._master_writer_fd = None
        if self.proc.stdin is not None:
            self.proc.stdin.close()

    def signal(self, signum: int) -> None:
        """Signals the whole process group: the shell the SDK wraps commands in and its children."""
        if self.proc.returncode is not None:
            raise NotFound(f"process with pid {self.pid} not found")
        try:
            os.killpg(self.pid, signum)
        except ProcessLookupError:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signum)

    async def write_input(self, data: bytes, *, pty: bool) -> None:
        if pty:
            if self.master_fd is None:
                raise FailedPrecondition(f"process {self.pid} has no terminal")
            await self._write_master(data)
            return
        if self.master_fd is not None:
            # A PTY process has no separate stdin; its input is the terminal.
            await self._write_master(data)
            return
        if self.proc.stdin is None:
            raise FailedPrecondition(f"process {self.pid} was started without stdin")
        if self.proc.stdin.is_closing():
            raise FailedPrecondition(f"stdin of process {self.pid} is closed")
        self.proc.stdin.write(data)
        try:
            await self.proc.stdin.drain()
        except (BrokenPipeError, ConnectionResetError):
            raise FailedPrecondition(f"process {self.pid} no longer reads stdin") from None

    async def _write_master(self, data: bytes) -> None:
        if self.master_fd is None:
            raise NotFound(f"process with pid {self.pid} not found")
        if self._master_writer_fd is None:
            self._master_writer_fd = os.dup(self.master_fd)
            os.set_blocking(self._master_writer_fd, False)
        view = memoryview(data)
        deadline = time.monotonic() + 30
        while view:
            try:
                written = os.write(self._master_writer_fd, view)
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise FailedPrecondition(f"terminal of {self.pid} is not reading") from None
                await asyncio.sleep(0.005)
                continue
            view = view[written:]

    def close_stdin(self) -> None:
        if self.master_fd is not None:
            raise FailedPrecondition("a PTY has no stdin to close; send Ctrl-D (0x04) instead")
        if self.proc.stdin is None:
            raise FailedPrecondition(f"process {self.pid} was started without stdin")
        self.proc.stdin.close()

    def resize(self, cols: int, rows: int) -> None:
        if self.master_fd is None:
            raise FailedPrecondition(f"process {self.pid} has no terminal to resize")
        if cols <= 0 or rows <= 0:
            raise InvalidArgument(f"terminal size must be positive, got {cols}x{rows}")
        set_winsize(self.master_fd, cols, rows)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGWINCH)
