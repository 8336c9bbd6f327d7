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
from collections.abc import AsyncIterator, Awaitable

from agentenv.control.store import SandboxRecord
from agentenv.http1 import Broken, Exchange, Unreachable, request_head
from agentenv.proxy.connections import log
from agentenv.proxy.cuts import (
    CONNECT_STREAM,
    NDJSON,
    ClientGone,
    Cut,
    EnvelopeTracker,
    LineTracker,
    SandboxGone,
    connect_end_stream_error,
    interpreter_error_line,
    unless_cut,
)
from agentenv.proxy.routing import CODE_INTERPRETER_PORT, ROUTING_HEADERS, Sandbox
from agentenv.proxy.upstream import (
    HOP_BY_HOP,
    https_port,
    not_found_body,
    raw_target_path,
    upstream_host,
)
from agentenv.proxy.websocket import WebSocketRelay
from agentenv.proxy.wire import Receive, Scope, Send, abort_response, send_json

CONNECT_STREAM_B = CONNECT_STREAM.encode()
NDJSON_B = NDJSON.encode()


class SandboxProxy(WebSocketRelay):
    """Forwards HTTP and WebSocket traffic to sandboxes (per-sandbox pools: `connections`)."""

    async def http(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        target: Sandbox,
        headers: dict[str, str] | None = None,
    ) -> None:
        """`headers`: the request's, names lowercased, if the caller has them already."""
        if headers is None:
            headers = {
                k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]
            }
        rec = await self._admit(target, headers, send)
        if rec is None:
            return
        host, forwarded_host = upstream_host(rec, target.port, headers.get("host", ""))
        fwd: list[tuple[bytes, bytes]] = []
        for k, v in scope["headers"]:
            name = k.decode("latin-1").lower()
            if name in HOP_BY_HOP or name in ROUTING_HEADERS or name == "expect":
                # `Expect: 100-continue` was the ASGI server's to answer (it did, once we
                # read the body); the body goes upstream without waiting for another one.
                continue
            if forwarded_host is not None and name in ("host", "x-forwarded-host"):
                continue
            fwd.append((k, v))
        if forwarded_host is not None:
            fwd.append((b"host", host.encode("latin-1")))
            if forwarded_host:
                fwd.append((b"x-forwarded-host", forwarded_host.encode("latin-1")))
        elif "host" not in headers:
            fwd.append((b"host", f"{rec.address}:{target.port}".encode("latin-1")))
        method = scope["method"]
        sized = "content-length" in headers
        first = b""
        more = False
        if sized or "chunked" in headers.get("transfer-encoding", ""):
            msg = await receive()
            if msg["type"] == "http.disconnect":
                self._metrics.proxy_requests.labels("client_gone").inc()
                return
            first = msg.get("body", b"")
            more = msg.get("more_body", False)
        chunked = more and not sized
        if chunked:
            fwd.append((b"transfer-encoding", b"chunked"))
        elif not sized and (first or method in ("POST", "PUT", "PATCH")):
            # A chunked body that came whole goes sized (as does an empty one where
            # servers expect a length).
            fwd.append((b"content-length", str(len(first)).encode()))
        out = request_head(
            method, raw_target_path(scope, target.path), fwd, scope.get("query_string", b"")
        )
        if first:
            out += b"%x\r\n%b\r\n" % (len(first), first) if chunked else first
        pool = await self._pool(rec, target.port, https_port(rec, target.port))
        with self._opened(rec.id) as cut:
            await self._exchange(
                rec,
                target,
                pool.exchange(bytes(out), head_request=method == "HEAD", replayable=not more),
                (receive, send),
                cut,
                len(first),
                more=more,
                chunked=chunked,
            )

    async def _exchange(
        self,
        rec: SandboxRecord,
        target: Sandbox,
        opening: Awaitable[Exchange],
        asgi: tuple[Receive, Send],
        cut: Cut,
        sent_up: int,
        *,
        more: bool,
        chunked: bool,
    ) -> None:
        receive, send = asgi

        async def rest() -> AsyncIterator[bytes]:
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

        try:
            exchange = await opening
        except Unreachable as exc:
            self._bytes_up.inc(sent_up)
            await self._no_answer(rec, target, send, cut, exc)
            return
        try:
            await self._answer(rec, target, exchange, cut, asgi, rest() if more else None, chunked)
        finally:
            exchange.release()
            self._bytes_up.inc(sent_up)

    async def _no_answer(
        self, rec: SandboxRecord, target: Sandbox, send: Send, cut: Cut, exc: Exception
    ) -> None:
        """Nothing came back: the sandbox was released meanwhile (the 502 of a sandbox not
        found), or its port does not answer."""
        if not cut.is_set():
            await self._unreachable(rec, target, send, exc)
            return
        self._metrics.proxy_requests.labels("sandbox_gone").inc()
        await send_json(send, 502, not_found_body(rec.id))

    async def _unreachable(
        self, rec: SandboxRecord, target: Sandbox, send: Send, exc: Exception
    ) -> None:
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
                "message": f"The sandbox {rec.id} is running but port {target.port} is not open",
            },
        )

    async def _answer(
        self,
        rec: SandboxRecord,
        target: Sandbox,
        exchange: Exchange,
        cut: Cut,
        asgi: tuple[Receive, Send],
        rest: AsyncIterator[bytes] | None,
        chunked: bool,
    ) -> None:
        receive, send = asgi
        try:
            if rest is not None:
                # A body still coming may idle for minutes: a cut must not wait for it.
                await unless_cut(exchange.send_body(rest, chunked=chunked), cut)
            await exchange.response()
        except ClientGone:
            self._metrics.proxy_requests.labels("client_gone").inc()
            return
        except (SandboxGone, Broken) as exc:
            await self._no_answer(rec, target, send, cut, exc)
            return
        self._requests_ok.inc()
        frames = _tracker(exchange, target.port)
        await send(
            {
                "type": "http.response.start",
                "status": exchange.status,
                "headers": [
                    (k, v)
                    for k, v in exchange.headers
                    if k.decode("latin-1").lower() not in HOP_BY_HOP
                ],
            }
        )
        state = {"finished": False, "client_gone": False}

        async def watch_disconnect() -> None:
            # A long stream (process output) must stop when its client goes away, or the
            # upstream connection would be held until the guest process ends.
            while (await receive())["type"] != "http.disconnect":
                pass
            if not state["finished"]:
                state["client_gone"] = True
                exchange.abort()

        watch = asyncio.create_task(watch_disconnect())
        down = self._bytes_down
        try:
            async for chunk in exchange.body():
                down.inc(len(chunk))
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
                if frames is not None:
                    frames.advance(chunk)
            state["finished"] = True
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except Broken as exc:
            if state["client_gone"]:
                return
            # Paused, killed or dead in the middle of a response. As E2B's proxy, which
            # resets its connections to a sandbox that stops: a Connect stream cut between
            # two frames is ended with an `unavailable` error frame (the SDKs probe
            # `/health`, get the 502 "was not found" of a sandbox no longer running, and
            # raise their "killed" error); a code interpreter execution cut between two
            # lines by a reset ends with an error line saying so; any other body, or a
            # stream cut mid-frame, has the client's connection dropped with the body
            # unfinished, never ended cleanly (a clean end would read as a complete body,
            # or as a Connect stream that lost its end message: "Command ended without an
            # end event").
            log.info(
                "sandbox %s port %d: response cut (%s)",
                rec.id,
                target.port,
                "sandbox released" if cut.is_set() else repr(exc),
                extra={"sandbox_id": rec.id},
            )
            end = None
            if isinstance(frames, EnvelopeTracker) and frames.at_boundary:
                end = connect_end_stream_error(
                    cut.why
                    or f"the connection to sandbox {rec.id} ended before the stream completed"
                )
            elif isinstance(frames, LineTracker) and frames.at_boundary and cut.why:
                # Only a reset: a killed sandbox's execution is dropped as E2B's proxy
                # drops it (the SDK then finds the sandbox gone and says so).
                end = interpreter_error_line(cut.why)
            if end is not None:
                with contextlib.suppress(Exception):
                    await send({"type": "http.response.body", "body": end, "more_body": False})
                return
            abort_response()
        finally:
            watch.cancel()


def _tracker(exchange: Exchange, port: int) -> EnvelopeTracker | LineTracker | None:
    """What follows the answer's framing, for the streams a cut ends cleanly: a Connect
    stream (envd's), the code interpreter's lines."""
    if exchange.status != 200:
        return None
    for k, v in exchange.headers:
        if k.lower() == b"content-type":
            if v.startswith(CONNECT_STREAM_B):
                return EnvelopeTracker()
            if port == CODE_INTERPRETER_PORT and v.startswith(NDJSON_B):
                return LineTracker()
            return None
    return None
