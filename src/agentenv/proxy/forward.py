"""Data-plane reverse proxy: stream HTTP and WebSocket traffic to a sandbox's slot address.

Bodies are relayed chunk by chunk in both directions (Connect streams, SSE, large uploads), so
nothing is buffered whole and a request body may stay open and idle for as long as the client
wants (the SDK's async stdin sends a keepalive only every 50 s). Each sandbox gets its own
connection pool to its slot address.

The rules for the upstream request live in `upstream`, the ends of cut streams in `cuts`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import httpx
from websockets.asyncio.client import ClientConnection
from websockets.asyncio.client import connect as ws_connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus
from websockets.typing import Subprotocol

from agentenv.control.metrics import Metrics
from agentenv.control.store import SandboxRecord
from agentenv.gateway.client import GatewayDialer, TunnelError
from agentenv.proxy.cuts import (
    CONNECT_STREAM,
    ClientGone,
    EnvelopeTracker,
    SandboxGone,
    connect_end_stream_error,
    unless_cut,
)
from agentenv.proxy.routing import ENVD_PORT, ROUTING_HEADERS, TRAFFIC_TOKEN_HEADER, Sandbox
from agentenv.proxy.upstream import (
    HOP_BY_HOP,
    UPSTREAM_LIMITS,
    UPSTREAM_TIMEOUT,
    UPSTREAM_TLS,
    WS_OWN_HEADERS,
    forwardable,
    https_port,
    not_found_body,
    raw_target_path,
    refusal,
    upstream_host,
    valid_authority,
)
from agentenv.proxy.wire import Receive, Scope, Send, abort_response, send_json

log = logging.getLogger("agentenv.proxy")


# The record of a running sandbox to forward to; a record in any other state (a paused sandbox
# that was not resumed) or None is refused.
Resolver = Callable[[str], Awaitable[SandboxRecord | None]]


# Told about every request that reaches a sandbox (memory reclaim keys idleness off it).
ActivityHook = Callable[[SandboxRecord], None]


# node id -> its data gateway (HOST:PORT), None to reach its guests' addresses directly.
GatewayOf = Callable[[str], Awaitable[str | None]]


class SandboxProxy:
    def __init__(
        self,
        resolve: Resolver,
        metrics: Metrics,
        on_activity: ActivityHook | None = None,
        *,
        gateway_of: GatewayOf | None = None,
        dialer: GatewayDialer | None = None,
    ) -> None:
        """With `gateway_of` and `dialer` (a cluster replica), a sandbox on a node that has a
        data gateway is reached through tunnels that node's gateway opens."""
        self._resolve = resolve
        self._metrics = metrics
        self._on_activity = on_activity
        self._gateway_of = gateway_of
        self._dialer = dialer
        # Per sandbox: (slot address, gateway or None) the pool goes to, and the pool.
        self._pools: dict[str, tuple[tuple[str, str | None], httpx.AsyncClient]] = {}
        # Per sandbox, one event per open request; `drop` sets them.
        self._open: dict[str, set[asyncio.Event]] = {}

    async def close(self) -> None:
        pools = list(self._pools.values())
        self._pools.clear()
        for _, client in pools:
            await client.aclose()

    async def drop(self, sandbox_id: str) -> None:
        """The sandbox stopped being reachable: end its open requests and its pool."""
        for cut in self._open.pop(sandbox_id, set()):
            cut.set()
        entry = self._pools.pop(sandbox_id, None)
        if entry is not None:
            await entry[1].aclose()

    @contextlib.contextmanager
    def _opened(self, sandbox_id: str) -> Iterator[asyncio.Event]:
        cut = asyncio.Event()
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

    async def _pool(self, rec: SandboxRecord) -> httpx.AsyncClient:
        assert rec.address is not None
        key = (rec.address, await self._via(rec))
        entry = self._pools.get(rec.id)
        if entry is not None and entry[0] == key:
            return entry[1]
        via = key[1]
        transport = None
        if via is not None:
            assert self._dialer is not None
            transport = self._dialer.transport(
                via, rec.id, limits=UPSTREAM_LIMITS, verify=UPSTREAM_TLS
            )
        client = httpx.AsyncClient(
            timeout=UPSTREAM_TIMEOUT,
            limits=UPSTREAM_LIMITS,
            trust_env=False,
            # Only used for `httpsPorts` (plain http elsewhere); see `_unverified_tls`.
            verify=UPSTREAM_TLS,
            transport=transport,
        )
        if entry is not None:
            # A resumed sandbox may sit on another slot or node; the old pool points nowhere.
            asyncio.get_running_loop().create_task(entry[1].aclose())
        self._pools[rec.id] = (key, client)
        return client

    async def _admit(
        self, target: Sandbox, headers: dict[str, str], send: Send
    ) -> SandboxRecord | None:
        rec = await self._resolve(target.sandbox_id)
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

    # -- HTTP ------------------------------------------------------------------------------

    async def http(self, scope: Scope, receive: Receive, send: Send, target: Sandbox) -> None:
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        rec = await self._admit(target, headers, send)
        if rec is None:
            return
        host, forwarded_host = upstream_host(rec, target.port, headers.get("host", ""))
        fwd: list[tuple[bytes, bytes]] = []
        for k, v in scope["headers"]:
            name = k.decode("latin-1").lower()
            if name in HOP_BY_HOP or name in ROUTING_HEADERS:
                continue
            if forwarded_host is not None and name in ("host", "x-forwarded-host"):
                continue
            fwd.append((k, v))
        if forwarded_host is not None:
            fwd.append((b"host", host.encode("latin-1")))
            if forwarded_host:
                fwd.append((b"x-forwarded-host", forwarded_host.encode("latin-1")))
        has_body = "content-length" in headers or "chunked" in headers.get("transfer-encoding", "")
        query = scope.get("query_string", b"")
        scheme = "https" if https_port(rec, target.port) else "http"
        url = f"{scheme}://{rec.address}:{target.port}{raw_target_path(scope, target.path)}"
        if query:
            url += "?" + query.decode("latin-1")
        sent_up = 0

        async def body() -> AsyncIterator[bytes]:
            nonlocal sent_up
            while True:
                msg = await receive()
                if msg["type"] == "http.disconnect":
                    raise ClientGone
                chunk = msg.get("body", b"")
                if chunk:
                    sent_up += len(chunk)
                    yield chunk
                if not msg.get("more_body", False):
                    return

        request = httpx.Request(
            scope["method"], url, headers=fwd, content=body() if has_body else None
        )
        client = await self._pool(rec)
        with self._opened(rec.id) as cut:
            await self._exchange(rec, target, client, request, receive, send, cut, lambda: sent_up)

    async def _exchange(
        self,
        rec: SandboxRecord,
        target: Sandbox,
        client: httpx.AsyncClient,
        request: httpx.Request,
        receive: Receive,
        send: Send,
        cut: asyncio.Event,
        sent: Callable[[], int],
    ) -> None:
        try:
            response = await unless_cut(client.send(request, stream=True), cut)
        except ClientGone:
            self._metrics.proxy_requests.labels("client_gone").inc()
            return
        except SandboxGone:
            self._metrics.proxy_requests.labels("sandbox_gone").inc()
            await send_json(send, 502, not_found_body(rec.id))
            return
        except httpx.TransportError as exc:
            self._metrics.proxy_requests.labels("upstream_error").inc()
            log.info(
                "sandbox %s port %d unreachable: %r",
                rec.id,
                target.port,
                exc,
                extra={"sandbox_id": rec.id},
            )
            await send_json(
                send,
                502,
                {
                    "code": 502,
                    "sandboxId": rec.id,
                    "message": f"The sandbox {rec.id} is running but port {target.port} "
                    "is not open",
                },
            )
            return
        finally:
            self._metrics.proxy_bytes.labels("up").inc(sent())
        self._metrics.proxy_requests.labels("ok").inc()
        connect_stream = response.status_code == 200 and response.headers.get(
            "content-type", ""
        ).startswith(CONNECT_STREAM)
        frames = EnvelopeTracker() if connect_stream else None
        try:
            out_headers = [
                (k, v)
                for k, v in response.headers.raw
                if k.decode("latin-1").lower() not in HOP_BY_HOP
            ]
            await send(
                {
                    "type": "http.response.start",
                    "status": response.status_code,
                    "headers": out_headers,
                }
            )
            await unless_cut(self._relay_body(response, receive, send, frames), cut)
        except (SandboxGone, httpx.TransportError) as exc:
            # Paused, killed or dead in the middle of a response. As E2B's proxy, which
            # resets its connections to a sandbox that stops: a Connect stream cut between
            # two frames is ended with an `unavailable` error frame (the SDKs probe
            # `/health`, get the 502 "was not found" of a sandbox no longer running, and
            # raise their "killed" error); any other body, or a stream cut mid-frame, has
            # the client's connection dropped with the body unfinished, never ended cleanly
            # (a clean end would read as a complete body, or as a Connect stream that lost
            # its end message: "Command ended without an end event").
            log.info(
                "sandbox %s port %d: response cut (%s)",
                rec.id,
                target.port,
                "sandbox released" if isinstance(exc, SandboxGone) else repr(exc),
                extra={"sandbox_id": rec.id},
            )
            if frames is not None and frames.at_boundary:
                message = f"the connection to sandbox {rec.id} ended before the stream completed"
                end = connect_end_stream_error(message)
                with contextlib.suppress(Exception):
                    await send({"type": "http.response.body", "body": end, "more_body": False})
                return
            abort_response()
        finally:
            await response.aclose()

    async def _relay_body(
        self,
        response: httpx.Response,
        receive: Receive,
        send: Send,
        frames: EnvelopeTracker | None = None,
    ) -> None:
        async def pump() -> None:
            async for chunk in response.aiter_raw():
                self._metrics.proxy_bytes.labels("down").inc(len(chunk))
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
                if frames is not None:
                    frames.advance(chunk)
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        async def watch_disconnect() -> None:
            # A long stream (process output) must stop when its client goes away, or the
            # upstream connection would be held until the guest process ends.
            while True:
                msg = await receive()
                if msg["type"] == "http.disconnect":
                    return

        pump_task = asyncio.create_task(pump())
        watch_task = asyncio.create_task(watch_disconnect())
        try:
            await asyncio.wait({pump_task, watch_task}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (pump_task, watch_task):
                task.cancel()
            await asyncio.gather(pump_task, watch_task, return_exceptions=True)
        if not pump_task.cancelled() and (exc := pump_task.exception()) is not None:
            # Aborting makes the server drop the connection, so the client sees a cut body.
            raise exc

    # -- WebSocket -------------------------------------------------------------------------

    async def websocket(self, scope: Scope, receive: Receive, send: Send, target: Sandbox) -> None:
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        first = await receive()
        if first["type"] != "websocket.connect":
            return
        rec = await self._resolve(target.sandbox_id)
        if not forwardable(rec):
            await _ws_reject(send, 502, refusal(target.sandbox_id, rec))
            return
        assert rec is not None
        if target.port != ENVD_PORT and not rec.allow_public_traffic:
            given = headers.get(TRAFFIC_TOKEN_HEADER, "")
            if not rec.traffic_token or not secrets.compare_digest(given, rec.traffic_token):
                await _ws_reject(
                    send, 403, {"code": 403, "message": f"missing {TRAFFIC_TOKEN_HEADER}"}
                )
                return
        if self._on_activity is not None:
            self._on_activity(rec)
        query = scope.get("query_string", b"")
        https = https_port(rec, target.port)
        # The URI's authority becomes the Host header (the same one a plain HTTP request
        # passes on); the socket goes to the slot address whatever it says.
        host, forwarded_host = upstream_host(rec, target.port, headers.get("host", ""))
        authority = host if valid_authority(host) else f"{rec.address}:{target.port}"
        url = f"{'wss' if https else 'ws'}://{authority}{raw_target_path(scope, target.path)}"
        if query:
            url += "?" + query.decode("latin-1")
        extra = [
            (k, v)
            for k, v in headers.items()
            if k not in HOP_BY_HOP
            and k not in ROUTING_HEADERS
            and k not in WS_OWN_HEADERS
            and not (forwarded_host is not None and k == "x-forwarded-host")
        ]
        if forwarded_host:
            extra.append(("x-forwarded-host", forwarded_host))
        subprotocols = [s.strip() for s in headers.get("sec-websocket-protocol", "").split(",")]
        # Through a node's gateway the socket is a tunnel's end; else the slot address.
        where: dict[str, Any] = {"host": rec.address, "port": target.port}
        relay: asyncio.Task[None] | None = None
        via = await self._via(rec)
        try:
            if via is not None:
                assert self._dialer is not None
                sock, relay = await self._dialer.socket(via, rec.id, target.port)
                where = {"sock": sock}
                if https:
                    where["server_hostname"] = rec.address
            upstream = await ws_connect(
                url,
                **where,
                ssl=UPSTREAM_TLS if https else None,
                additional_headers=extra,
                subprotocols=[Subprotocol(s) for s in subprotocols if s] or None,
                open_timeout=10,
                max_size=None,
                ping_interval=None,
                compression=None,
                user_agent_header=None,
            )
        except InvalidStatus as exc:
            await _cancel(relay)
            await _ws_reject(
                send,
                exc.response.status_code,
                {"code": exc.response.status_code, "message": "upstream refused the WebSocket"},
            )
            return
        except (OSError, InvalidHandshake, TimeoutError, TunnelError) as exc:
            await _cancel(relay)
            await _ws_reject(
                send,
                502,
                {
                    "code": 502,
                    "message": f"port {target.port} in sandbox {rec.id} is not open: {exc}",
                },
            )
            return
        except BaseException:
            await _cancel(relay)
            raise
        try:
            async with upstream:
                await send({"type": "websocket.accept", "subprotocol": upstream.subprotocol})
                with self._opened(rec.id) as cut:
                    try:
                        await unless_cut(self._ws_pump(upstream, receive, send), cut)
                    except SandboxGone:
                        # As E2B's proxy, which resets its connections to a sandbox that
                        # stops: no close frame, the client's connection is dropped (returning
                        # without a close makes uvicorn close the socket), so the client
                        # sees an abnormal closure (1006), never a clean or server-error end.
                        log.info(
                            "sandbox %s port %d: WebSocket cut (sandbox released)",
                            rec.id,
                            target.port,
                            extra={"sandbox_id": rec.id},
                        )
                        # The guest is gone: no closing handshake to wait out with it.
                        upstream.transport.abort()
                        return
        finally:
            await _cancel(relay)

    async def _ws_pump(self, upstream: ClientConnection, receive: Receive, send: Send) -> None:
        async def down() -> None:
            try:
                async for message in upstream:
                    if isinstance(message, bytes):
                        self._metrics.proxy_bytes.labels("down").inc(len(message))
                        await send({"type": "websocket.send", "bytes": message})
                    else:
                        self._metrics.proxy_bytes.labels("down").inc(len(message))
                        await send({"type": "websocket.send", "text": message})
            except ConnectionClosed:
                pass
            code = upstream.close_code or 1000
            with contextlib.suppress(Exception):
                await send({"type": "websocket.close", "code": code})

        async def up() -> None:
            while True:
                msg = await receive()
                if msg["type"] == "websocket.disconnect":
                    await upstream.close(code=msg.get("code", 1000))
                    return
                if msg.get("bytes") is not None:
                    self._metrics.proxy_bytes.labels("up").inc(len(msg["bytes"]))
                    await upstream.send(msg["bytes"])
                elif msg.get("text") is not None:
                    self._metrics.proxy_bytes.labels("up").inc(len(msg["text"]))
                    await upstream.send(msg["text"])

        tasks = [asyncio.create_task(down()), asyncio.create_task(up())]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError, ConnectionClosed):
                    await task


async def _cancel(task: asyncio.Task[None] | None) -> None:
    if task is not None:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def _ws_reject(send: Send, status: int, body: dict[str, Any]) -> None:
    """Refuse a WebSocket handshake with a JSON HTTP answer (ASGI websocket.http.response)."""
    payload = json.dumps(body).encode()
    try:
        await send(
            {
                "type": "websocket.http.response.start",
                "status": status,
                "headers": [(b"content-type", b"application/json")],
            }
        )
        await send({"type": "websocket.http.response.body", "body": payload})
    except Exception:
        # Servers without the extension can only refuse with a bare 403.
        await send({"type": "websocket.close", "code": 1008})
