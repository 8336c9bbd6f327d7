"""One node agent's channel (`NodeChannel`): the client's state and settings, TLS options, the
Connect client, and `_call`: every call with its deadline and the node's failures turned
into the contract's classes (`NodeUnreachable` naming the node when it does not answer).
Split from `client.py`; the background streams (`node_streams`) and `client.RemoteRuntime`
are built over it."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from connectrpc.code import Code
from connectrpc.errors import ConnectError
from pyqwest import HTTPTransport

from agentenv.config import NodeRpcConfig
from agentenv.contract.runtime import Unsupported

from .errors import NodeError, NodeUnreachable, failure_of, from_failure
from .gen.node_connect import NodeServiceClient

log = logging.getLogger("agentenv.noderpc")
T = TypeVar("T")
# WatchLost: silence (no event, no heartbeat) that means a dead stream.
WATCH_SILENCE_S = 15.0


class NodeChannel:
    """A node agent's URL, settings and Connect client, and the deadline of every call."""

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
        if err.code is Code.UNIMPLEMENTED:
            # An agent of an older version, without this call: callers with another way to
            # do it take it (a reset becomes a delete and a create).
            return Unsupported(f"node {self.url}: {method} is not implemented by this node")
        if err.code is Code.DEADLINE_EXCEEDED:
            return self._unreachable(method, f"no answer within {deadline_s:g} s")
        if err.code is Code.UNAVAILABLE:
            return self._unreachable(method, err.message or "connection failed")
        return NodeError(f"node {self.url}: {method} failed ({err.code.value}): {err.message}")

    def _unreachable(self, method: str, why: str) -> NodeUnreachable:
        return NodeUnreachable(
            f"node {self.url} unreachable ({method}: {why})", self.config.retry_after_s
        )
