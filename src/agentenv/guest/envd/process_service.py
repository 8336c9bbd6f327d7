"""The `process.Process` Connect service."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import AsyncIterator
from typing import Any, Literal

from connectrpc.code import Code
from connectrpc.errors import ConnectError
from protobuf import Oneof

from . import paths
from .errors import InvalidArgument
from .gen.process import process_pb as pb
from .gen.process.process_connect import Process
from .output_hub import EndInfo, Output, Subscription
from .process_table import ProcessTable
from .processes import ManagedProcess, ProcessSpec
from .rpc import acting_user, streaming, timeout_seconds, unary
from .state import EnvdState

_SIGNALS = {
    pb.Signal.SIGKILL: signal.SIGKILL,
    pb.Signal.SIGTERM: signal.SIGTERM,
}


def keepalive_interval(ctx: Any) -> float | None:
    """`Keepalive-Ping-Interval` (seconds) asks for a keepalive event after that much silence."""
    raw = ctx.request_headers.get("keepalive-ping-interval")
    if not raw:
        return None
    try:
        value = float(raw)
    except ValueError:
        raise InvalidArgument(f"invalid Keepalive-Ping-Interval header: {raw!r}") from None
    return value if value > 0 else None


def _start_event(pid: int) -> pb.ProcessEvent:
    start = pb.ProcessEvent.StartEvent(pid=pid)
    return pb.ProcessEvent(
        event=Oneof[Literal["start"], pb.ProcessEvent.StartEvent]("start", start)
    )


def _keepalive_event() -> pb.ProcessEvent:
    ping = pb.ProcessEvent.KeepAlive()
    return pb.ProcessEvent(
        event=Oneof[Literal["keepalive"], pb.ProcessEvent.KeepAlive]("keepalive", ping)
    )


def _data_event(item: Output) -> pb.ProcessEvent:
    output: Any = Oneof(item.stream, item.data)
    data = pb.ProcessEvent.DataEvent(output=output)
    return pb.ProcessEvent(event=Oneof[Literal["data"], pb.ProcessEvent.DataEvent]("data", data))


def _end_event(end: EndInfo) -> pb.ProcessEvent:
    info = pb.ProcessEvent.EndEvent(
        exit_code=end.exit_code, exited=end.exited, status=end.status, error=end.error
    )
    return pb.ProcessEvent(event=Oneof[Literal["end"], pb.ProcessEvent.EndEvent]("end", info))


async def process_events(
    managed: ManagedProcess, sub: Subscription, keepalive: float | None, *, is_start: bool
) -> AsyncIterator[pb.ProcessEvent]:
    """start, then output as it comes, then end; keepalives fill silent stretches."""
    try:
        yield _start_event(managed.pid)
        while True:
            try:
                item = await asyncio.wait_for(sub.queue.get(), keepalive)
            except TimeoutError:
                yield _keepalive_event()
                continue
            if isinstance(item, Output):
                yield _data_event(item)
                continue
            if is_start and managed.deadline_hit:
                # What upstream envd does: the request context expired, so the stream ends with
                # deadline_exceeded (the SDK raises TimeoutException) rather than an exit.
                raise ConnectError(
                    Code.DEADLINE_EXCEEDED, "process exceeded its timeout and was killed"
                )
            yield _end_event(item)
            return
    finally:
        sub.close()


def _selector(selector: pb.ProcessSelector | None) -> tuple[int | None, str | None]:
    if selector is None or selector.selector is None:
        raise InvalidArgument("process selector is required")
    match selector.selector:
        case Oneof(field="pid", value=pid):
            return int(pid), None
        case Oneof(field="tag", value=tag):
            return None, str(tag)
    raise InvalidArgument("process selector needs a pid or a tag")


class ProcessService(Process):
    def __init__(self, state: EnvdState, table: ProcessTable) -> None:
        self.state = state
        self.table = table

    def _find(self, selector: pb.ProcessSelector | None) -> ManagedProcess:
        pid, tag = _selector(selector)
        return self.table.find(pid=pid, tag=tag)

    @streaming
    async def start(self, request: pb.StartRequest, ctx: Any) -> AsyncIterator[pb.StartResponse]:
        user = acting_user(self.state, ctx)
        config = request.process
        if config is None:
            raise InvalidArgument("process config is required")
        pty_size: tuple[int, int] | None = None
        if request.pty is not None:
            size = request.pty.size
            pty_size = (size.cols, size.rows) if size is not None else (80, 24)
        env = user.login_env()
        env.update(self.state.env_vars)
        env.update(config.envs)
        # As upstream's ExpandAndResolve: the request's cwd, else the default workdir, else
        # the home directory; `~` and relative paths start at the user's home.
        cwd = paths.resolve_cwd(config.cwd or self.state.default_workdir, user)
        spec = ProcessSpec(
            cmd=config.cmd,
            args=tuple(config.args),
            envs=dict(config.envs),
            cwd=config.cwd or None,
            # protobuf-py reads an absent optional field as its zero value; ask for presence.
            tag=(request.tag or None) if request.has_field("tag") else None,
            stdin=request.stdin if request.has_field("stdin") else True,
            pty_size=pty_size,
        )
        keepalive = keepalive_interval(ctx)
        managed, sub = await self.table.start(spec, user, env, cwd, timeout_seconds(ctx))
        async for event in process_events(managed, sub, keepalive, is_start=True):
            yield pb.StartResponse(event=event)

    @streaming
    async def connect(
        self, request: pb.ConnectRequest, ctx: Any
    ) -> AsyncIterator[pb.ConnectResponse]:
        acting_user(self.state, ctx)
        managed = self._find(request.process)
        keepalive = keepalive_interval(ctx)
        sub = managed.hub.subscribe()
        async for event in process_events(managed, sub, keepalive, is_start=False):
            yield pb.ConnectResponse(event=event)

    @unary
    async def list(self, request: pb.ListRequest, ctx: Any) -> pb.ListResponse:
        acting_user(self.state, ctx)
        processes = []
        for managed in self.table.by_pid.values():
            spec = managed.spec
            config = pb.ProcessConfig(
                cmd=spec.cmd, args=list(spec.args), envs=dict(spec.envs), cwd=spec.cwd
            )
            processes.append(pb.ProcessInfo(config=config, pid=managed.pid, tag=spec.tag))
        return pb.ListResponse(processes=processes)

    @unary
    async def send_input(self, request: pb.SendInputRequest, ctx: Any) -> pb.SendInputResponse:
        acting_user(self.state, ctx)
        managed = self._find(request.process)
        await _write(managed, request.input)
        return pb.SendInputResponse()

    @unary
    async def stream_input(
        self, requests: AsyncIterator[pb.StreamInputRequest], ctx: Any
    ) -> pb.StreamInputResponse:
        acting_user(self.state, ctx)
        managed: ManagedProcess | None = None
        async for message in requests:
            match message.event:
                case Oneof(field="start", value=pb.StreamInputRequest.StartEvent() as start):
                    managed = self._find(start.process)
                case Oneof(field="data", value=pb.StreamInputRequest.DataEvent() as data):
                    if managed is None:
                        raise InvalidArgument("StreamInput data arrived before its start event")
                    await _write(managed, data.input)
                case _:
                    continue
        return pb.StreamInputResponse()

    @unary
    async def send_signal(self, request: pb.SendSignalRequest, ctx: Any) -> pb.SendSignalResponse:
        acting_user(self.state, ctx)
        managed = self._find(request.process)
        signum = _SIGNALS.get(request.signal)
        if signum is None:
            raise InvalidArgument(f"unsupported signal {request.signal!r}")
        managed.signal(signum)
        return pb.SendSignalResponse()

    @unary
    async def close_stdin(self, request: pb.CloseStdinRequest, ctx: Any) -> pb.CloseStdinResponse:
        acting_user(self.state, ctx)
        self._find(request.process).close_stdin()
        return pb.CloseStdinResponse()

    @unary
    async def update(self, request: pb.UpdateRequest, ctx: Any) -> pb.UpdateResponse:
        acting_user(self.state, ctx)
        managed = self._find(request.process)
        if request.pty is not None and request.pty.size is not None:
            managed.resize(request.pty.size.cols, request.pty.size.rows)
        return pb.UpdateResponse()


async def _write(managed: ManagedProcess, data: pb.ProcessInput | None) -> None:
    if data is None or data.input is None:
        raise InvalidArgument("input is empty")
    match data.input:
        case Oneof(field="stdin", value=raw):
            await managed.write_input(bytes(raw), pty=False)
        case Oneof(field="pty", value=raw):
            await managed.write_input(bytes(raw), pty=True)
