"""`RemoteRuntime`: the `Runtime` contract as calls to a node agent's `NodeService`.

Every call has a deadline (queries short, changes longer, VM operations long: `NodeRpcConfig`)
and the node's failures come back as the contract's classes. A node that does not answer is
`NodeUnreachable` (an `Unavailable`: the API answers 503 with a Retry-After) naming the node.
`note_activity` never waits: ids are batched and sent by a background task. `watch_lost`
follows the node's lost-sandbox stream in the background, reconnecting when it breaks.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

from connectrpc.code import Code
from connectrpc.errors import ConnectError
from pyqwest import Client as HTTPClient
from pyqwest import HTTPTransport, Proxy

from agentenv.config import NodeRpcConfig, Settings
from agentenv.contract.runtime import (
    Found,
    HostMemory,
    ImportEvent,
    Placement,
    Runtime,
    SandboxSpec,
    SnapshotInfo,
    TemplateInfo,
)
from agentenv.network.egress import Egress

from . import convert
from .convert import opt_str
from .errors import NodeError, NodeUnreachable, failure_of, from_failure
from .gen import node_pb as pb
from .gen.node_connect import NodeServiceClient

log = logging.getLogger("agentenv.noderpc")

T = TypeVar("T")

# note_activity: ids waiting to be sent at most (the oldest are dropped beyond), ids per
# call, and how long a first id waits for others to join its batch.
ACTIVITY_PENDING_MAX = 16384
ACTIVITY_BATCH = 2048
ACTIVITY_LINGER_S = 0.2
ACTIVITY_RETRY_S = 1.0
# WatchLost: reconnect backoff, and silence (no event, no heartbeat) that means a dead stream.
WATCH_BACKOFF_MIN_S = 0.2
WATCH_BACKOFF_MAX_S = 5.0
WATCH_SILENCE_S = 15.0
# An image import pulls every layer it lacks: minutes for a large image on a slow link.
IMPORT_DEADLINE_S = 1800.0


class RemoteRuntime:
    """A node's `Runtime`, reached at `url` (`http(s)://host:port`) with the node token; an
    https node's certificate is checked against `config.tls_ca` (else the system store)."""

    def __init__(
        self,
        url: str,
        token: str,
        *,
        timeout_s: float | None = None,
        config: NodeRpcConfig | None = None,
        watch_silence_s: float = WATCH_SILENCE_S,
    ) -> None:
        if not token:
            raise ValueError("a node RPC client needs the node token")
        cfg = config or NodeRpcConfig()
        self.url = url.rstrip("/")
        self.config = cfg
        # `timeout_s` shortens every deadline at once (tests, a caller in a hurry).
        self._query_s = cfg.query_s if timeout_s is None else min(cfg.query_s, timeout_s)
        self._change_s = cfg.change_s if timeout_s is None else min(cfg.change_s, timeout_s)
        self._long_s = cfg.long_s if timeout_s is None else min(cfg.long_s, timeout_s)
        self._headers = {"authorization": f"Bearer {token}"}
        self._watch_silence_s = watch_silence_s
        self._transport: HTTPTransport | None = None
        self._rpc: NodeServiceClient | None = None
        self._handlers: list[Callable[[str, str], None]] = []
        self._watch_task: asyncio.Task[None] | None = None
        # Insertion-ordered set: an id noted twice before a flush is sent once.
        self._activity: dict[str, None] = {}
        self._activity_wake = asyncio.Event()
        self._activity_task: asyncio.Task[None] | None = None
        self.activity_dropped = 0

    @classmethod
    def from_settings(cls, url: str, settings: Settings) -> RemoteRuntime:
        """A client of the node at `url` with the settings' token and deadlines."""
        if not settings.node_token:
            raise ValueError("AGENTENV_NODE_TOKEN is not set: the node RPC needs it")
        return cls(url, settings.node_token, config=settings.node_rpc)

    # lifecycle ---------------------------------------------------------------------------

    async def _tls_options(self) -> dict[str, Any]:
        """How the transport verifies a node's certificate: against the configured CA bundle,
        else (an https URL) against the system store. Never unverified."""
        ca = self.config.tls_ca
        if ca is not None:
            try:
                pem = await asyncio.to_thread(ca.read_bytes)
            except OSError as exc:
                raise NodeError(f"node {self.url}: cannot read the node CA {ca}: {exc}") from exc
            return {"tls_ca_cert": pem}
        if self.url.startswith("https://"):
            return {"tls_include_system_certs": True}
        return {}

    async def start(self) -> None:
        if self._rpc is not None:
            return
        tls = await self._tls_options()
        if self._rpc is not None:
            return
        self._transport = HTTPTransport(
            **tls,
            connect_timeout=self.config.connect_s,
            # Shorter than the server's keep-alive (75 s), so an idle connection is closed
            # by us, never reused just as the server closes it.
            pool_idle_timeout=30.0,
            pool_max_idle_per_host=64,
            tcp_keepalive_interval=15.0,
            # A node is reached directly: HTTP(S)_PROXY from the environment must not apply.
            # An explicit proxy turns the environment's off; this one matches no host (every
            # IPv4, every IPv6 and, for names, "*"), so nothing goes through it.
            proxy=Proxy("http://127.0.0.1:9", no_proxy="0.0.0.0/0,::/0,*"),
            follow_redirects=False,
            enable_otel=False,
        )
        self._rpc = NodeServiceClient(
            self.url, http_client=HTTPClient(self._transport), send_compression=None
        )
        self._activity_task = asyncio.create_task(self._send_activity())
        if self._handlers:
            self._start_watch()

    async def close(self) -> None:
        tasks = [t for t in (self._watch_task, self._activity_task) if t is not None]
        self._watch_task = self._activity_task = None
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        rpc, transport = self._rpc, self._transport
        self._rpc = self._transport = None
        if rpc is not None:
            await rpc.close()
        if transport is not None:
            await transport.aclose()

    # calls -------------------------------------------------------------------------------

    def _client(self) -> NodeServiceClient:
        if self._rpc is None:
            raise RuntimeError(f"RemoteRuntime({self.url}) used before start() or after close()")
        return self._rpc

    async def _call(self, method: str, deadline_s: float, call: Callable[[int], Awaitable[T]]) -> T:
        """One unary call within `deadline_s`; Connect errors become the contract's."""
        self._client()
        timeout_ms = max(1, int(deadline_s * 1000))
        # The library's own deadline covers the HTTP exchange; this one also covers anything
        # around it, so no call outlives its deadline (by more than a second).
        guard = asyncio.timeout(deadline_s + 1.0)
        try:
            async with guard:
                return await call(timeout_ms)
        except TimeoutError:
            raise self._unreachable(method, f"no answer within {deadline_s:g} s") from None
        except ConnectError as err:
            if guard.expired():
                # The library turned our guard's cancellation into its own error.
                raise self._unreachable(method, f"no answer within {deadline_s:g} s") from None
            raise self._translate(method, err, deadline_s) from None

    def _translate(self, method: str, err: ConnectError, deadline_s: float) -> BaseException:
        task = asyncio.current_task()
        if err.code is Code.CANCELED and task is not None and task.cancelling():
            # The library turns our own cancellation into an error; give it back as one.
            return asyncio.CancelledError()
        failure = failure_of(err)
        if failure is not None:
            exc = from_failure(failure)
            if exc is not None:
                return exc
            return NodeError(f"node {self.url}: {method}: {failure.kind}: {failure.message}")
        if err.code is Code.DEADLINE_EXCEEDED:
            return self._unreachable(method, f"no answer within {deadline_s:g} s")
        if err.code is Code.UNAVAILABLE:
            return self._unreachable(method, err.message or "connection failed")
        return NodeError(f"node {self.url}: {method} failed ({err.code.value}): {err.message}")

    def _unreachable(self, method: str, why: str) -> NodeUnreachable:
        return NodeUnreachable(
            f"node {self.url} unreachable ({method}: {why})", self.config.retry_after_s
        )

    async def create(self, spec: SandboxSpec) -> Placement:
        req = pb.CreateRequest(spec=convert.spec_to_pb(spec))
        res = await self._call(
            "Create",
            self._long_s,
            lambda ms: self._client().create(req, headers=self._headers, timeout_ms=ms),
        )
        return convert.placement_from_pb(res.placement)

    async def update_egress(self, sandbox_id: str, egress: Egress) -> None:
        req = pb.UpdateEgressRequest(sandbox_id=sandbox_id, egress=convert.egress_to_pb(egress))
        await self._call(
            "UpdateEgress",
            self._change_s,
            lambda ms: self._client().update_egress(req, headers=self._headers, timeout_ms=ms),
        )

    async def delete(self, sandbox_id: str) -> None:
        req = pb.SandboxRef(sandbox_id=sandbox_id)
        await self._call(
            "Delete",
            self._change_s,
            lambda ms: self._client().delete(req, headers=self._headers, timeout_ms=ms),
        )

    async def forget(self, sandbox_id: str) -> None:
        req = pb.SandboxRef(sandbox_id=sandbox_id)
        await self._call(
            "Forget",
            self._change_s,
            lambda ms: self._client().forget(req, headers=self._headers, timeout_ms=ms),
        )

    async def pause(
        self,
        sandbox_id: str,
        *,
        memory: bool = True,
        envd_token: str | None = None,
        strict: bool = True,
    ) -> None:
        req = pb.PauseRequest(
            sandbox_id=sandbox_id, memory=memory, envd_token=envd_token, strict=strict
        )
        await self._call(
            "Pause",
            self._long_s,
            lambda ms: self._client().pause(req, headers=self._headers, timeout_ms=ms),
        )

    async def resume(self, spec: SandboxSpec, *, memory: bool = True) -> Placement:
        req = pb.ResumeRequest(spec=convert.spec_to_pb(spec), memory=memory)
        res = await self._call(
            "Resume",
            self._long_s,
            lambda ms: self._client().resume(req, headers=self._headers, timeout_ms=ms),
        )
        return convert.placement_from_pb(res.placement)

    async def init_guest(self, spec: SandboxSpec) -> None:
        req = pb.InitGuestRequest(spec=convert.spec_to_pb(spec))
        await self._call(
            "InitGuest",
            self._change_s,
            lambda ms: self._client().init_guest(req, headers=self._headers, timeout_ms=ms),
        )

    async def guest_metrics(self, sandbox_id: str, envd_token: str | None) -> dict[str, Any] | None:
        req = pb.GuestMetricsRequest(sandbox_id=sandbox_id, envd_token=envd_token)
        res = await self._call(
            "GuestMetrics",
            self._query_s,
            lambda ms: self._client().guest_metrics(req, headers=self._headers, timeout_ms=ms),
        )
        text = opt_str(res, "json")
        if text is None:
            return None
        sample = json.loads(text)
        if not isinstance(sample, dict):
            raise NodeError(f"node {self.url}: GuestMetrics sent {type(sample).__name__}")
        return sample

    async def guest_health(self, sandbox_id: str) -> str | None:
        req = pb.SandboxRef(sandbox_id=sandbox_id)
        res = await self._call(
            "GuestHealth",
            self._query_s,
            lambda ms: self._client().guest_health(req, headers=self._headers, timeout_ms=ms),
        )
        return opt_str(res, "text")

    async def is_alive(self, sandbox_id: str) -> bool:
        req = pb.SandboxRef(sandbox_id=sandbox_id)
        res = await self._call(
            "IsAlive",
            self._query_s,
            lambda ms: self._client().is_alive(req, headers=self._headers, timeout_ms=ms),
        )
        return res.alive

    async def find(self, sandbox_id: str) -> Found | None:
        req = pb.SandboxRef(sandbox_id=sandbox_id)
        res = await self._call(
            "Find",
            self._query_s,
            lambda ms: self._client().find(req, headers=self._headers, timeout_ms=ms),
        )
        return None if res.found is None else convert.found_from_pb(res.found)

    async def sandbox_ids(self) -> list[str]:
        res = await self._call(
            "SandboxIds",
            self._query_s,
            lambda ms: self._client().sandbox_ids(pb.Empty(), headers=self._headers, timeout_ms=ms),
        )
        return list(res.sandbox_ids)

    async def lost_reason(self, sandbox_id: str) -> str | None:
        req = pb.SandboxRef(sandbox_id=sandbox_id)
        res = await self._call(
            "LostReason",
            self._query_s,
            lambda ms: self._client().lost_reason(req, headers=self._headers, timeout_ms=ms),
        )
        return opt_str(res, "text")

    async def snapshot(
        self, sandbox_id: str, name: str | None, envd_token: str | None, *, memory: bool = True
    ) -> SnapshotInfo:
        req = pb.SnapshotRequest(
            sandbox_id=sandbox_id, name=name, envd_token=envd_token, memory=memory
        )
        res = await self._call(
            "Snapshot",
            self._long_s,
            lambda ms: self._client().snapshot(req, headers=self._headers, timeout_ms=ms),
        )
        return convert.snapshot_from_pb(res)

    async def fork(
        self, sandbox_id: str, children: list[SandboxSpec], envd_token: str | None
    ) -> list[Placement]:
        req = pb.ForkRequest(
            sandbox_id=sandbox_id,
            children=[convert.spec_to_pb(c) for c in children],
            envd_token=envd_token,
        )
        res = await self._call(
            "Fork",
            self._long_s,
            lambda ms: self._client().fork(req, headers=self._headers, timeout_ms=ms),
        )
        return [convert.placement_from_pb(p) for p in res.placements]

    async def snapshots(self) -> list[SnapshotInfo]:
        res = await self._call(
            "Snapshots",
            self._query_s,
            lambda ms: self._client().snapshots(pb.Empty(), headers=self._headers, timeout_ms=ms),
        )
        return [convert.snapshot_from_pb(s) for s in res.snapshots]

    async def import_image(
        self,
        ref: str,
        name: str,
        credentials: tuple[str, str] | None,
        on_event: Callable[[ImportEvent], None],
    ) -> TemplateInfo:
        if credentials is None:
            req = pb.ImportImageRequest(ref=ref, name=name)
        else:
            user, password = credentials
            req = pb.ImportImageRequest(ref=ref, name=name, username=user, password=password)

        async def run(ms: int) -> TemplateInfo:
            done: TemplateInfo | None = None
            stream = self._client().import_image(req, headers=self._headers, timeout_ms=ms)
            async for event in stream:
                if event.has_field("template_json"):
                    done = TemplateInfo.from_json(event.template_json)
                elif event.has_field("layer_json"):
                    on_event(ImportEvent(layer=json.loads(event.layer_json)))
                else:
                    on_event(ImportEvent(message=event.message))
            if done is None:
                raise NodeError(f"node {self.url}: the import of {ref} ended without a template")
            return done

        return await self._call("ImportImage", IMPORT_DEADLINE_S, run)

    async def delete_snapshot(self, snapshot_id: str) -> bool:
        req = pb.SnapshotRef(snapshot_id=snapshot_id)
        res = await self._call(
            "DeleteSnapshot",
            self._change_s,
            lambda ms: self._client().delete_snapshot(req, headers=self._headers, timeout_ms=ms),
        )
        return bool(res.deleted)

    async def remove_image(self, name: str) -> bool:
        req = pb.ImageRef(name=name)
        res = await self._call(
            "RemoveImage",
            self._change_s,
            lambda ms: self._client().remove_image(req, headers=self._headers, timeout_ms=ms),
        )
        return bool(res.deleted)

    async def host_memory(self, sandbox_id: str) -> HostMemory | None:
        req = pb.SandboxRef(sandbox_id=sandbox_id)
        res = await self._call(
            "HostMemory",
            self._query_s,
            lambda ms: self._client().host_memory(req, headers=self._headers, timeout_ms=ms),
        )
        return None if res.memory is None else convert.memory_from_pb(res.memory)

    # activity ----------------------------------------------------------------------------

    async def gateway(self, node_id: str) -> str | None:
        """Guests of this node are reached at their slot addresses."""
        return None

    def note_activity(self, sandbox_id: str) -> None:
        pending = self._activity
        if sandbox_id in pending:
            return
        if len(pending) >= ACTIVITY_PENDING_MAX:
            # Drop the oldest: the newest traffic is what decides whether a sandbox is idle.
            del pending[next(iter(pending))]
            self.activity_dropped += 1
        pending[sandbox_id] = None
        self._activity_wake.set()

    async def _send_activity(self) -> None:
        while True:
            await self._activity_wake.wait()
            await asyncio.sleep(ACTIVITY_LINGER_S)
            self._activity_wake.clear()
            while self._activity:
                batch: list[str] = []
                for sandbox_id in self._activity:
                    batch.append(sandbox_id)
                    if len(batch) >= ACTIVITY_BATCH:
                        break
                for sandbox_id in batch:
                    del self._activity[sandbox_id]
                try:
                    await self._note(batch)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:
                    # Activity is a hint: a node that missed it sees the next traffic. A node
                    # that is down is not asked again at once (nor logged about every time).
                    log.warning("node %s: %d activity notes lost: %s", self.url, len(batch), exc)
                    await asyncio.sleep(ACTIVITY_RETRY_S)

    async def _note(self, batch: list[str]) -> None:
        req = pb.NoteActivityRequest(sandbox_ids=batch)
        await self._call(
            "NoteActivity",
            self._query_s,
            lambda ms: self._client().note_activity(req, headers=self._headers, timeout_ms=ms),
        )

    # lost sandboxes ----------------------------------------------------------------------

    def watch_lost(self, handler: Callable[[str, str], None]) -> None:
        self._handlers.append(handler)
        if self._rpc is not None:
            self._start_watch()

    def _start_watch(self) -> None:
        if self._watch_task is None or self._watch_task.done():
            self._watch_task = asyncio.create_task(self._watch())

    async def _watch(self) -> None:
        epoch, seq = "", 0
        backoff = WATCH_BACKOFF_MIN_S
        while True:
            try:
                stream = self._client().watch_lost(
                    pb.WatchLostRequest(epoch=epoch, after_seq=seq), headers=self._headers
                )
                async for event in _with_silence_limit(stream, self._watch_silence_s):
                    backoff = WATCH_BACKOFF_MIN_S
                    if event.epoch != epoch:
                        epoch, seq = event.epoch, 0
                    seq = max(seq, event.seq)
                    if not event.heartbeat:
                        self._deliver(event.sandbox_id, event.why)
                why = "stream ended"
            except asyncio.CancelledError:
                raise
            except TimeoutError:
                why = f"silent for {self._watch_silence_s:g} s"
            except ConnectError as err:
                task = asyncio.current_task()
                if task is not None and task.cancelling():
                    raise asyncio.CancelledError() from None
                why = f"{err.code.value}: {err.message}"
            except Exception as exc:
                why = f"{type(exc).__name__}: {exc}"
            log.info(
                "node %s: lost-sandbox stream broke (%s); again in %.1f s", self.url, why, backoff
            )
            await asyncio.sleep(backoff * random.uniform(0.8, 1.2))
            backoff = min(backoff * 2, WATCH_BACKOFF_MAX_S)

    def _deliver(self, sandbox_id: str, why: str) -> None:
        for handler in list(self._handlers):
            try:
                handler(sandbox_id, why)
            except Exception:
                log.exception("lost handler failed for %s", sandbox_id)


async def _with_silence_limit(stream: AsyncIterator[T], silence_s: float) -> AsyncIterator[T]:
    """`stream`'s items; TimeoutError if none comes for `silence_s` (then the stream is closed)."""
    it = aiter(stream)
    try:
        while True:
            try:
                async with asyncio.timeout(silence_s):
                    item = await anext(it)
            except StopAsyncIteration:
                return
            yield item
    finally:
        close = getattr(it, "aclose", None)
        if close is not None:
            with contextlib.suppress(Exception):
                await close()


if TYPE_CHECKING:

    def _is_a_runtime(remote: RemoteRuntime) -> Runtime:
        # mypy proves RemoteRuntime implements the whole protocol here.
        return remote
