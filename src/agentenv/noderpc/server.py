"""Serves any `Runtime` as `agentenv.node.v1.NodeService` to callers holding the node token.

`node_app(runtime, token)` is the ASGI app; `NodeServer` runs it under uvicorn on a TCP port
(HTTPS when given a certificate and key, else plain HTTP) and `serve(...)` runs that until
cancelled. The caller owns the runtime's
lifecycle (`start`/`close`): many control-plane clients may come and go, the node stays.

The handlers themselves are `service.NodeService`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import socket
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import uvicorn

from agentenv.contract.runtime import Runtime
from agentenv.guest import quiet_server
from agentenv.noderpc.service import HEARTBEAT_S, NodeService

from .gen.node_connect import NodeServiceASGIApplication

log = logging.getLogger("agentenv.noderpc")

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

# Requests larger than this are refused (a fork of many children is the largest we send).
READ_MAX_BYTES = 4 * 1024 * 1024


class _Authenticated:
    """Lets a request through to the Connect app only with `Authorization: Bearer <token>`;
    anything else gets Connect's `unauthenticated` (401) and the runtime never sees it."""

    def __init__(self, app: NodeServiceASGIApplication, token: str, service: NodeService) -> None:
        if not token:
            raise ValueError("the node RPC needs a non-empty token")
        self._app = app
        self.service = service
        self._expected = f"Bearer {token}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        if not self._allowed(scope):
            await _connect_error(send, 401, "unauthenticated", "missing or invalid node token")
            return
        if str(scope.get("path", "")).endswith("/WatchLost"):
            # Streams watch for the client's disconnect themselves (connectrpc).
            await self._app(scope, receive, send)
            return
        await _cancel_on_disconnect(self._app, scope, receive, send)

    def _allowed(self, scope: Scope) -> bool:
        given = b""
        for key, value in scope.get("headers", ()):
            if bytes(key).lower() == b"authorization":
                given = bytes(value)
                break
        return hmac.compare_digest(given, self._expected)


async def _cancel_on_disconnect(
    app: NodeServiceASGIApplication, scope: Scope, receive: Receive, send: Send
) -> None:
    """Runs a unary call, cancelling it if the caller goes away before the answer.

    In-process, a caller that is cancelled cancels the runtime call with it; over the wire
    that would be lost (uvicorn lets a unary handler run on after a disconnect), and a create
    nobody waits for would leave a sandbox the control plane does not know. Once the request
    body is in, one more `receive()` returns only when the client disconnects.
    """
    body_read = asyncio.Event()
    gone = False

    async def tracked_receive() -> dict[str, Any]:
        message = await receive()
        if message["type"] == "http.disconnect" or not message.get("more_body", False):
            body_read.set()
        return message

    call = asyncio.create_task(app(scope, tracked_receive, send))

    async def watch() -> None:
        nonlocal gone
        await body_read.wait()
        message = await receive()
        if message["type"] == "http.disconnect" and not call.done():
            gone = True
            call.cancel()

    watcher = asyncio.create_task(watch())
    try:
        await call
    except asyncio.CancelledError:
        if not gone:
            raise
        log.info("%s: caller disconnected; call cancelled", scope.get("path"))
    finally:
        watcher.cancel()


async def _connect_error(send: Send, status: int, code: str, message: str) -> None:
    body = json.dumps({"code": code, "message": message}).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


def node_app(runtime: Runtime, token: str, *, heartbeat_s: float = HEARTBEAT_S) -> Any:
    """The ASGI app serving `runtime` to callers that send `token` (its `.service` is the
    `NodeService`)."""
    service = NodeService(runtime, heartbeat_s=heartbeat_s)
    app = NodeServiceASGIApplication(service, read_max_bytes=READ_MAX_BYTES)
    return _Authenticated(app, token, service)


def _listen(host: str, port: int) -> socket.socket:
    # proto=IPPROTO_TCP, not 0 (`socket.create_server`'s): asyncio sets TCP_NODELAY on
    # accepted connections only when their proto says TCP, and without it every response
    # waits for the client's delayed ACK (40 ms a call on loopback).
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(1024)
    except BaseException:
        sock.close()
        raise
    return sock


class NodeServer:
    """`node_app` under uvicorn on `host:port` (port 0: any free one, see `.port`)."""

    def __init__(
        self,
        runtime: Runtime,
        host: str,
        port: int,
        token: str,
        *,
        heartbeat_s: float = HEARTBEAT_S,
        log_level: str = "warning",
        tls_cert: Path | None = None,
        tls_key: Path | None = None,
    ) -> None:
        if (tls_cert is None) != (tls_key is None):
            raise ValueError("a TLS node server needs both its certificate and its key")
        self.host = host
        self.tls = tls_cert is not None
        self._sock = _listen(host, port)
        self.port: int = self._sock.getsockname()[1]
        self._app = node_app(runtime, token, heartbeat_s=heartbeat_s)
        config = uvicorn.Config(
            self._app,
            log_level=log_level,
            lifespan="off",
            access_log=False,
            # Longer than the client's pool idle time, so the client closes an idle
            # connection before the server does and never sends on one being closed.
            timeout_keep_alive=75,
            # A stream (WatchLost) never ends on its own; shutdown must not wait for it.
            timeout_graceful_shutdown=2,
            ssl_certfile=None if tls_cert is None else str(tls_cert),
            ssl_keyfile=None if tls_key is None else str(tls_key),
        )
        self._server = quiet_server.Server(config)
        self._task: asyncio.Task[None] | None = None

    @property
    def url(self) -> str:
        scheme = "https" if self.tls else "http"
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{scheme}://{host}:{self.port}"

    async def start(self) -> None:
        self._task = asyncio.create_task(self._server.serve(sockets=[self._sock]))
        try:
            async with asyncio.timeout(10):
                while not self._server.started:
                    if self._task.done():
                        self._task.result()
                        raise RuntimeError("node RPC server stopped while starting")
                    await asyncio.sleep(0.01)
        except BaseException:
            # Cancelled (or failed) while starting: the server may already be serving.
            await self.stop()
            raise

    async def wait(self) -> None:
        """Until the server stops (uvicorn exits on SIGINT/SIGTERM)."""
        if self._task is not None:
            await asyncio.shield(self._task)

    async def stop(self) -> None:
        if self._task is None:
            self._sock.close()
            return
        # Open WatchLost streams end first: uvicorn's graceful shutdown then has nothing to
        # wait out (and nothing to cancel, which logged a traceback per stream).
        self._app.service.close_streams()
        self._server.request_exit()
        try:
            async with asyncio.timeout(10):
                await self._task
        except TimeoutError:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        finally:
            self._sock.close()
            self._task = None


async def serve(
    runtime: Runtime,
    host: str,
    port: int,
    token: str,
    *,
    tls_cert: Path | None = None,
    tls_key: Path | None = None,
) -> None:
    """Serves `runtime` on `host:port` until cancelled (or uvicorn's SIGINT/SIGTERM)."""
    server = NodeServer(
        runtime, host, port, token, log_level="info", tls_cert=tls_cert, tls_key=tls_key
    )
    try:
        await server.start()
        log.info("node RPC listening on %s", server.url)
        await server.wait()
    finally:
        await server.stop()
