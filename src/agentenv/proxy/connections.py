"""What the sandbox proxy holds per sandbox (`ProxyConnections`): its connection pools to the
slot address (through the node's data gateway on a cluster), the requests open to it so a
release ends them (`drop`), and admitting a request (resolve the record, refuse one that is
not running, note activity). Split from `forward.py`; HTTP (`forward`) and WebSocket
(`websocket`) relaying are built over it."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import secrets
import time
from collections.abc import Awaitable, Callable, Iterator

from agentenv.control.metrics import Metrics
from agentenv.control.store import SandboxRecord
from agentenv.gateway.client import GatewayDialer, TunnelError
from agentenv.http1 import READ_CHUNK, Dial, Unreachable, UpstreamPool
from agentenv.ports import ENVD_PORT
from agentenv.proxy.cuts import Cut
from agentenv.proxy.routing import TRAFFIC_TOKEN_HEADER, Sandbox
from agentenv.proxy.upstream import (
    SETTLE_WAIT_S,
    SETTLING,
    UPSTREAM_TLS,
    forwardable,
    refusal,
    unsettled,
    waits_out,
)
from agentenv.proxy.wire import Send, send_json

log = logging.getLogger("agentenv.proxy")
# The record of a running sandbox to forward to; a record in any other state (a paused sandbox
# that was not resumed) or None is refused.
Resolver = Callable[[str], Awaitable[SandboxRecord | None]]
# Told about every request that reaches a sandbox (memory reclaim keys idleness off it).
ActivityHook = Callable[[SandboxRecord], None]
# node id -> its data gateway (HOST:PORT), None to reach its guests' addresses directly.
GatewayOf = Callable[[str], Awaitable[str | None]]
# The store is read again after 20 ms, then at doubling intervals up to 250 ms.
SETTLE_POLL_S = 0.02
SETTLE_POLL_MAX_S = 0.25


class _SandboxPools:
    """One sandbox's pools, one per port (and TLS or not) it was reached on."""

    def __init__(self) -> None:
        self.ports: dict[tuple[int, bool], UpstreamPool] = {}

    async def aclose(self) -> None:
        for pool in self.ports.values():
            await pool.aclose()


class ProxyConnections:
    """Per-sandbox pools and open requests of the proxy."""

    def __init__(
        self,
        resolve: Resolver,
        metrics: Metrics,
        on_activity: ActivityHook | None = None,
        *,
        gateway_of: GatewayOf | None = None,
        dialer: GatewayDialer | None = None,
        settle_wait_s: float = SETTLE_WAIT_S,
    ) -> None:
        """With `gateway_of` and `dialer` (a cluster replica), a sandbox on a node that has a
        data gateway is reached through tunnels that node's gateway opens. `settle_wait_s`:
        how long a request waits out its sandbox's transition (`SETTLING`)."""
        self._resolve = resolve
        self._settle_wait_s = settle_wait_s
        self._metrics = metrics
        # The children every proxied request counts in, looked up once (`labels()`
        # validates its arguments and takes the metric's lock on each call).
        self._requests_ok = metrics.proxy_requests.labels("ok")
        self._bytes_up = metrics.proxy_bytes.labels("up")
        self._bytes_down = metrics.proxy_bytes.labels("down")
        self._on_activity = on_activity
        self._gateway_of = gateway_of
        self._dialer = dialer
        # Per sandbox: (slot address, gateway or None) its pools go to, and the pools.
        self._pools: dict[str, tuple[tuple[str, str | None], _SandboxPools]] = {}
        # Per sandbox, one event per open request; `drop` sets them.
        self._open: dict[str, set[Cut]] = {}

    async def close(self) -> None:
        pools = list(self._pools.values())
        self._pools.clear()
        for _, client in pools:
            await client.aclose()

    async def drop(self, sandbox_id: str, why: str | None = None) -> None:
        """The sandbox stopped being reachable: end its open requests and its pool. `why`:
        the sandbox lives on (a reset), and its clients are told so: a clean WebSocket close
        and a Connect error carrying it, not the dropped connection of a stopped sandbox."""
        for cut in self._open.pop(sandbox_id, set()):
            cut.why = why
            cut.set()
        entry = self._pools.pop(sandbox_id, None)
        if entry is not None:
            await entry[1].aclose()

    def open_requests(self, sandbox_id: str) -> int:
        """Requests and WebSockets to the sandbox this proxy has open now (a long command's
        stream is one): its client is there even when it sends nothing new."""
        return len(self._open.get(sandbox_id, ()))

    @contextlib.contextmanager
    def _opened(self, sandbox_id: str) -> Iterator[Cut]:
        cut = Cut()
        self._open.setdefault(sandbox_id, set()).add(cut)
        try:
            yield cut
        finally:
            open_here = self._open.get(sandbox_id)
            if open_here is not None:
                open_here.discard(cut)
                if not open_here:
                    del self._open[sandbox_id]

    async def _via(self, rec: SandboxRecord) -> str | None:
        """The data gateway the sandbox is reached through, None for its address itself."""
        if rec.node_id is None or self._gateway_of is None or self._dialer is None:
            return None
        return await self._gateway_of(rec.node_id)

    async def _pool(self, rec: SandboxRecord, port: int, tls: bool) -> UpstreamPool:
        """The sandbox's pool to `port` (in TLS for its `httpsPorts`)."""
        assert rec.address is not None
        key = (rec.address, await self._via(rec))
        entry = self._pools.get(rec.id)
        if entry is None or entry[0] != key:
            if entry is not None:
                # A resumed sandbox may sit on another slot or node; the old pools point
                # nowhere.
                asyncio.get_running_loop().create_task(entry[1].aclose())
            entry = (key, _SandboxPools())
            self._pools[rec.id] = entry
        pools = entry[1]
        pool = pools.ports.get((port, tls))
        if pool is None:
            pool = pools.ports[(port, tls)] = UpstreamPool(self._dial(rec.id, key, port, tls))
        return pool

    def _dial(self, sandbox_id: str, key: tuple[str, str | None], port: int, tls: bool) -> Dial:
        address, via = key
        # Only used for `httpsPorts` (plain http elsewhere); see `_unverified_tls`.
        context = UPSTREAM_TLS if tls else None
        if via is None:
            return functools.partial(
                asyncio.open_connection, address, port, ssl=context, limit=READ_CHUNK
            )
        dialer = self._dialer
        assert dialer is not None

        async def tunnel() -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
            try:
                reader, writer = await dialer.open(via, sandbox_id, port)
            except TunnelError as exc:
                raise Unreachable(str(exc)) from exc
            if context is not None:
                try:
                    # Within the pool's connect deadline, as the tunnel itself.
                    await writer.start_tls(context)
                except BaseException:
                    # A guest's TLS that fails (or a deadline) must not leave the tunnel open.
                    writer.close()
                    raise
            return reader, writer

        return tunnel

    async def _settled(self, sandbox_id: str) -> tuple[SandboxRecord | None, bool]:
        """The sandbox's record once it is in no transition (`SETTLING`); False with it when
        it still was after the wait."""
        rec = await self._resolve(sandbox_id)
        if rec is None or rec.state not in SETTLING or not waits_out(rec, time.time()):
            return rec, True
        deadline = time.monotonic() + self._settle_wait_s
        pause = SETTLE_POLL_S
        while rec is not None and rec.state in SETTLING:
            left = deadline - time.monotonic()
            if left <= 0:
                return rec, False
            await asyncio.sleep(min(pause, left))
            pause = min(2 * pause, SETTLE_POLL_MAX_S)
            rec = await self._resolve(sandbox_id)
        return rec, True

    async def _admit(
        self, target: Sandbox, headers: dict[str, str], send: Send
    ) -> SandboxRecord | None:
        rec, settled = await self._settled(target.sandbox_id)
        if not settled:
            assert rec is not None
            self._metrics.proxy_requests.labels("unsettled").inc()
            body = unsettled(rec, self._settle_wait_s)
            await send_json(send, 503, body, [(b"retry-after", b"1")])
            return None
        if not forwardable(rec):
            await self.drop(target.sandbox_id)
            self._metrics.proxy_requests.labels("not_found").inc()
            await send_json(send, 502, refusal(target.sandbox_id, rec))
            return None
        assert rec is not None
        if target.port != ENVD_PORT and not rec.allow_public_traffic:
            given = headers.get(TRAFFIC_TOKEN_HEADER, "")
            if not rec.traffic_token or not secrets.compare_digest(given, rec.traffic_token):
                self._metrics.proxy_requests.labels("forbidden").inc()
                await send_json(
                    send,
                    403,
                    {
                        "code": 403,
                        "message": f"sandbox {rec.id} requires a valid {TRAFFIC_TOKEN_HEADER} "
                        f"header for port {target.port}",
                    },
                )
                return None
        if self._on_activity is not None:
            self._on_activity(rec)
        return rec
