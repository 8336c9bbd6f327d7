"""Data-plane reverse proxy: stream HTTP and WebSocket traffic to a sandbox's slot address.

Bodies are relayed chunk by chunk in both directions (Connect streams, SSE, large uploads), so
nothing is buffered whole and a request body may stay open and idle for as long as the client
wants (the SDK's async stdin sends a keepalive only every 50 s). Each sandbox gets its own
connection pool to its slot address.

The rules for the upstream request live in `upstream`, the ends of cut streams in `cuts`,
the per-sandbox pools and open requests in `connections`, WebSocket relaying in `websocket`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

import httpx

from agentenv.control.store import SandboxRecord
from agentenv.proxy.connections import log
from agentenv.proxy.cuts import (
    CONNECT_STREAM,
    ClientGone,
    Cut,
    EnvelopeTracker,
    SandboxGone,
    connect_end_stream_error,
    unless_cut,
)
from agentenv.proxy.routing import ROUTING_HEADERS, Sandbox
from agentenv.proxy.upstream import (
    HOP_BY_HOP,
    https_port,
    not_found_body,
    raw_target_path,
    upstream_host,
)
from agentenv.proxy.websocket import WebSocketRelay
from agentenv.proxy.wire import Receive, Scope, Send, abort_response, send_json


class SandboxProxy(WebSocketRelay):
    """Forwards HTTP and WebSocket traffic to sandboxes (per-sandbox pools: `connections`)."""

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
        cut: Cut,
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
                message = (
                    cut.why
                    or f"the connection to sandbox {rec.id} ended before the stream completed"
                )
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
