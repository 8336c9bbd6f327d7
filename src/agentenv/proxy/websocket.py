"""Relaying a WebSocket to a sandbox port (`WebSocketRelay`): the upstream handshake (its
refusal passed on as an HTTP answer), frames both ways, and a cut by the sandbox's release
dropping the client without a close frame, as E2B's proxy does. Split from `forward.py`."""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
from typing import Any

from websockets.asyncio.client import ClientConnection
from websockets.asyncio.client import connect as ws_connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus
from websockets.typing import Subprotocol

from agentenv.gateway.client import TunnelError
from agentenv.ports import ENVD_PORT
from agentenv.proxy.connections import ProxyConnections, log
from agentenv.proxy.cuts import SandboxGone, unless_cut
from agentenv.proxy.routing import ROUTING_HEADERS, TRAFFIC_TOKEN_HEADER, Sandbox
from agentenv.proxy.upstream import (
    HOP_BY_HOP,
    UPSTREAM_TLS,
    WS_OWN_HEADERS,
    forwardable,
    https_port,
    raw_target_path,
    refusal,
    unsettled,
    upstream_host,
    valid_authority,
)
from agentenv.proxy.wire import Receive, Scope, Send


class WebSocketRelay(ProxyConnections):
    """The WebSocket side of the sandbox proxy."""

    async def websocket(self, scope: Scope, receive: Receive, send: Send, target: Sandbox) -> None:
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        first = await receive()
        if first["type"] != "websocket.connect":
            return
        rec, settled = await self._settled(target.sandbox_id)
        if not settled:
            assert rec is not None
            await _ws_reject(send, 503, unsettled(rec, self._settle_wait_s))
            return
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
                        if cut.why is not None:
                            # The sandbox lives on (a reset): a clean close the client can
                            # act on, 1012 ("service restart") with the reason.
                            await send(
                                {
                                    "type": "websocket.close",
                                    "code": 1012,
                                    "reason": cut.why.encode()[:120].decode(errors="ignore"),
                                }
                            )
                            upstream.transport.abort()
                            return
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
                        self._bytes_down.inc(len(message))
                        await send({"type": "websocket.send", "bytes": message})
                    else:
                        self._bytes_down.inc(len(message))
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
                    self._bytes_up.inc(len(msg["bytes"]))
                    await upstream.send(msg["bytes"])
                elif msg.get("text") is not None:
                    self._bytes_up.inc(len(msg["text"]))
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
