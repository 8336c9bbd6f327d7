"""`NodeService`: the node RPC's handlers, each a `Runtime` call with its request decoded
(a bad message is `invalid_argument`) and the runtime's typed failures carried back as
Connect errors the client turns into the contract's classes; `WatchLost` streams lost
sandboxes with heartbeats. Split from `server.py`, which authenticates and serves it."""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from connectrpc.code import Code
from connectrpc.errors import ConnectError
from connectrpc.request import RequestContext

from agentenv.contract.runtime import GuestCommand, ImportEvent, Placement, Runtime, SandboxSpec

from . import convert
from .convert import opt_str
from .errors import allowed_kind, to_connect
from .gen import node_pb as pb
from .gen.node_connect import NodeService as NodeServiceProtocol

log = logging.getLogger("agentenv.noderpc")
T = TypeVar("T")
# A WatchLost stream with no event for this long gets a heartbeat, so a client can tell a
# quiet node from a dead connection (it reconnects after a few missed ones).
HEARTBEAT_S = 5.0
# Lost events kept for a client that reconnects (and for one that has not connected yet).
BACKLOG = 1024


async def _call(ctx: RequestContext[Any, Any], what: str, call: Awaitable[T]) -> T:
    """Runs one runtime call within the caller's deadline, its failures as Connect errors.

    The node stops working on a call its caller has given up on (the deadline travels in
    the request), so a create that timed out is cancelled here, not left running unseen.
    """
    remaining = ctx.timeout_ms
    try:
        async with asyncio.timeout(None if remaining is None else max(remaining, 0) / 1000):
            return await call
    except TimeoutError:
        raise ConnectError(Code.DEADLINE_EXCEEDED, f"{what} did not finish in time") from None
    except ConnectError:
        raise
    except Exception as exc:
        kind = allowed_kind(exc)
        if kind is not None:
            raise to_connect(exc, kind) from None
        log.exception("%s failed", what)
        raise ConnectError(Code.INTERNAL, f"{what} failed: {type(exc).__name__}: {exc}") from None


class NodeService(NodeServiceProtocol):
    """The generated `NodeService` protocol over one `Runtime`."""

    def __init__(
        self, runtime: Runtime, *, heartbeat_s: float = HEARTBEAT_S, backlog: int = BACKLOG
    ) -> None:
        self.runtime = runtime
        self.heartbeat_s = heartbeat_s
        # One per server process: a client that saw another epoch asks for all we hold.
        self.epoch = secrets.token_hex(8)
        self._seq = 0
        self._events: deque[pb.LostEvent] = deque(maxlen=backlog)
        self._changed = asyncio.Event()
        self._closing = False
        runtime.watch_lost(self._on_lost)

    def close_streams(self) -> None:
        """Ends every WatchLost stream (the server is stopping): each returns as a normal end
        of stream, so shutdown neither waits for them nor cancels them mid-wait."""
        self._closing = True
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    def _on_lost(self, sandbox_id: str, why: str) -> None:
        # Called by the runtime on the event loop; streams wake and send what they lack.
        self._seq += 1
        self._events.append(
            pb.LostEvent(epoch=self.epoch, seq=self._seq, sandbox_id=sandbox_id, why=why)
        )
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    async def create(
        self, request: pb.CreateRequest, ctx: RequestContext[Any, Any]
    ) -> pb.PlacementResponse:
        spec = _spec(request.spec)
        return _placed(await _call(ctx, "create", self.runtime.create(spec)))

    async def update_egress(
        self, request: pb.UpdateEgressRequest, ctx: RequestContext[Any, Any]
    ) -> pb.Empty:
        egress = _decode(lambda: convert.egress_from_pb(request.egress))
        await _call(ctx, "update_egress", self.runtime.update_egress(request.sandbox_id, egress))
        return pb.Empty()

    async def delete(self, request: pb.SandboxRef, ctx: RequestContext[Any, Any]) -> pb.Empty:
        await _call(ctx, "delete", self.runtime.delete(request.sandbox_id))
        return pb.Empty()

    async def forget(self, request: pb.SandboxRef, ctx: RequestContext[Any, Any]) -> pb.Empty:
        await _call(ctx, "forget", self.runtime.forget(request.sandbox_id))
        return pb.Empty()

    async def pause(self, request: pb.PauseRequest, ctx: RequestContext[Any, Any]) -> pb.Empty:
        call = self.runtime.pause(
            request.sandbox_id,
            memory=request.memory,
            envd_token=opt_str(request, "envd_token"),
            strict=request.strict,
        )
        await _call(ctx, "pause", call)
        return pb.Empty()

    async def resume(
        self, request: pb.ResumeRequest, ctx: RequestContext[Any, Any]
    ) -> pb.PlacementResponse:
        spec = _spec(request.spec)
        return _placed(await _call(ctx, "resume", self.runtime.resume(spec, memory=request.memory)))

    async def reset(
        self, request: pb.ResetRequest, ctx: RequestContext[Any, Any]
    ) -> pb.PlacementResponse:
        spec = _spec(request.spec)
        return _placed(await _call(ctx, "reset", self.runtime.reset(spec)))

    async def init_guest(
        self, request: pb.InitGuestRequest, ctx: RequestContext[Any, Any]
    ) -> pb.Empty:
        spec = _spec(request.spec)
        await _call(ctx, "init_guest", self.runtime.init_guest(spec))
        return pb.Empty()

    async def guest_metrics(
        self, request: pb.GuestMetricsRequest, ctx: RequestContext[Any, Any]
    ) -> pb.OptionalJson:
        call = self.runtime.guest_metrics(request.sandbox_id, opt_str(request, "envd_token"))
        sample = await _call(ctx, "guest_metrics", call)
        if sample is None:
            return pb.OptionalJson()
        try:
            return pb.OptionalJson(json=json.dumps(sample))
        except (TypeError, ValueError) as exc:
            log.error("guest_metrics of %s is not JSON: %s", request.sandbox_id, exc)
            raise ConnectError(Code.INTERNAL, f"guest_metrics: not JSON: {exc}") from None

    async def guest_health(
        self, request: pb.SandboxRef, ctx: RequestContext[Any, Any]
    ) -> pb.OptionalText:
        why = await _call(ctx, "guest_health", self.runtime.guest_health(request.sandbox_id))
        return pb.OptionalText(text=why)

    async def is_alive(
        self, request: pb.SandboxRef, ctx: RequestContext[Any, Any]
    ) -> pb.AliveResponse:
        alive = await _call(ctx, "is_alive", self.runtime.is_alive(request.sandbox_id))
        return pb.AliveResponse(alive=alive)

    async def find(self, request: pb.SandboxRef, ctx: RequestContext[Any, Any]) -> pb.FindResponse:
        found = await _call(ctx, "find", self.runtime.find(request.sandbox_id))
        return pb.FindResponse(found=None if found is None else convert.found_to_pb(found))

    async def sandbox_ids(
        self, request: pb.Empty, ctx: RequestContext[Any, Any]
    ) -> pb.SandboxIdsResponse:
        ids = await _call(ctx, "sandbox_ids", self.runtime.sandbox_ids())
        return pb.SandboxIdsResponse(sandbox_ids=list(ids))

    async def lost_reason(
        self, request: pb.SandboxRef, ctx: RequestContext[Any, Any]
    ) -> pb.OptionalText:
        why = await _call(ctx, "lost_reason", self.runtime.lost_reason(request.sandbox_id))
        return pb.OptionalText(text=why)

    async def watch_lost(
        self, request: pb.WatchLostRequest, ctx: RequestContext[Any, Any]
    ) -> AsyncIterator[pb.LostEvent]:
        # Same epoch: resume after what the client saw; another (a restarted node): all.
        cursor = request.after_seq if request.epoch == self.epoch else 0
        while not self._closing:
            changed = self._changed
            pending = [e for e in self._events if e.seq > cursor]
            for event in pending:
                yield event
                cursor = event.seq
            if pending:
                continue
            try:
                async with asyncio.timeout(self.heartbeat_s):
                    await changed.wait()
            except TimeoutError:
                yield pb.LostEvent(epoch=self.epoch, seq=cursor, heartbeat=True)

    async def snapshot(
        self, request: pb.SnapshotRequest, ctx: RequestContext[Any, Any]
    ) -> pb.SnapshotInfo:
        call = self.runtime.snapshot(
            request.sandbox_id,
            opt_str(request, "name"),
            opt_str(request, "envd_token"),
            memory=request.memory,
        )
        info = await _call(ctx, "snapshot", call)
        return convert.snapshot_to_pb(info)

    async def fork(self, request: pb.ForkRequest, ctx: RequestContext[Any, Any]) -> pb.ForkResponse:
        children = [_spec(c) for c in request.children]
        call = self.runtime.fork(request.sandbox_id, children, opt_str(request, "envd_token"))
        placements = await _call(ctx, "fork", call)
        return pb.ForkResponse(placements=[convert.placement_to_pb(p) for p in placements])

    async def snapshots(
        self, request: pb.Empty, ctx: RequestContext[Any, Any]
    ) -> pb.SnapshotsResponse:
        infos = await _call(ctx, "snapshots", self.runtime.snapshots())
        return pb.SnapshotsResponse(snapshots=[convert.snapshot_to_pb(i) for i in infos])

    async def import_image(
        self, request: pb.ImportImageRequest, ctx: RequestContext[Any, Any]
    ) -> AsyncIterator[pb.ImportEvent]:
        """The import runs as a task; its reports stream as they come (from any thread), the
        registered template last. A client that goes away cancels the import."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[pb.ImportEvent | None] = asyncio.Queue()

        def on_event(event: ImportEvent) -> None:
            layer = json.dumps(event.layer) if event.layer is not None else None
            msg = pb.ImportEvent(message=event.message, layer_json=layer)
            loop.call_soon_threadsafe(queue.put_nowait, msg)

        creds = None
        if request.has_field("username"):
            creds = (request.username, opt_str(request, "password") or "")
        work = self.runtime.import_image(request.ref, request.name, creds, on_event)
        task = asyncio.create_task(_call(ctx, "import_image", work))
        task.add_done_callback(lambda _: loop.call_soon_threadsafe(queue.put_nowait, None))
        try:
            while (event := await queue.get()) is not None:
                yield event
            info = task.result()
            yield pb.ImportEvent(template_json=info.to_json())
        finally:
            task.cancel()

    async def delete_snapshot(
        self, request: pb.SnapshotRef, ctx: RequestContext[Any, Any]
    ) -> pb.DeletedResponse:
        deleted = await _call(
            ctx, "delete_snapshot", self.runtime.delete_snapshot(request.snapshot_id)
        )
        return pb.DeletedResponse(deleted=deleted)

    async def remove_image(
        self, request: pb.ImageRef, ctx: RequestContext[Any, Any]
    ) -> pb.DeletedResponse:
        removed = await _call(ctx, "remove_image", self.runtime.remove_image(request.name))
        return pb.DeletedResponse(deleted=removed)

    async def note_activity(
        self, request: pb.NoteActivityRequest, ctx: RequestContext[Any, Any]
    ) -> pb.Empty:
        for sandbox_id in request.sandbox_ids:
            self.runtime.note_activity(sandbox_id)
        return pb.Empty()

    async def host_memory(
        self, request: pb.SandboxRef, ctx: RequestContext[Any, Any]
    ) -> pb.HostMemoryResponse:
        mem = await _call(ctx, "host_memory", self.runtime.host_memory(request.sandbox_id))
        return pb.HostMemoryResponse(memory=None if mem is None else convert.memory_to_pb(mem))

    async def guest_run(
        self, request: pb.GuestRunRequest, ctx: RequestContext[Any, Any]
    ) -> AsyncIterator[pb.GuestRunEvent]:
        """The command runs as a task; its lines stream as they come, the exit code last. A
        client that goes away cancels it (envd then ends the process)."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[pb.GuestRunEvent | None] = asyncio.Queue()

        def on_line(line: str, stream: str) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, pb.GuestRunEvent(line=line, stream=stream))

        command = GuestCommand(
            cmd=request.cmd,
            user=request.user or "root",
            envs=dict(request.envs),
            cwd=opt_str(request, "cwd"),
            timeout_s=request.timeout_s or GuestCommand.timeout_s,
        )
        token = opt_str(request, "envd_token")
        work = self.runtime.guest_run(request.sandbox_id, token, command, on_line)
        task = asyncio.create_task(_call(ctx, "guest_run", work))
        task.add_done_callback(lambda _: loop.call_soon_threadsafe(queue.put_nowait, None))
        try:
            while (event := await queue.get()) is not None:
                yield event
            yield pb.GuestRunEvent(exit_code=task.result())
        finally:
            task.cancel()

    async def guest_write(
        self, request: pb.GuestWriteRequest, ctx: RequestContext[Any, Any]
    ) -> pb.Empty:
        token = opt_str(request, "envd_token")
        work = self.runtime.guest_write(
            request.sandbox_id, token, request.path, bytes(request.data), append=request.append
        )
        await _call(ctx, "guest_write", work)
        return pb.Empty()

    async def guest_defaults(
        self, request: pb.GuestDefaultsRequest, ctx: RequestContext[Any, Any]
    ) -> pb.Empty:
        token = opt_str(request, "envd_token")
        work = self.runtime.guest_defaults(request.sandbox_id, token, request.user, request.workdir)
        await _call(ctx, "guest_defaults", work)
        return pb.Empty()


def _decode(fn: Callable[[], T]) -> T:
    """A request value that does not convert (bad egress target, no spec) is the caller's."""
    try:
        return fn()
    except ValueError as exc:
        raise ConnectError(Code.INVALID_ARGUMENT, f"invalid request: {exc}") from None


def _placed(placement: Placement) -> pb.PlacementResponse:
    return pb.PlacementResponse(placement=convert.placement_to_pb(placement))


def _spec(msg: pb.SandboxSpec | None) -> SandboxSpec:
    return _decode(lambda: convert.spec_from_pb(msg))
