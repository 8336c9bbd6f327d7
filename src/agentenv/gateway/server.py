"""The node side: an HTTP CONNECT server that joins a replica's tunnel to a guest port.

One request per connection: ``CONNECT <sandbox id>:<port> HTTP/1.1`` with
``Proxy-Authorization: Bearer <node token>`` (or Basic with the token as password, as
generic CONNECT clients send it). The answer is ``200`` and then the bytes of the guest's
port both ways, or an error with a ``{"code","message"}`` body and the connection closed:
400 a malformed request, 405 another method, 407 no or a wrong token, 404 no such sandbox
running here, 502 the guest does not accept on that port, 504 it did not answer in time,
503 the gateway holds `max_tunnels` open already.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import json
import logging
import secrets
import ssl
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from agentenv.pump import both_ways, stream_flow

log = logging.getLogger(__name__)

# A request head is a line and a few headers; anything longer is not our client.
MAX_HEAD_BYTES = 16 * 1024
HEAD_TIMEOUT_S = 10.0
CONNECT_TIMEOUT_S = 5.0
CHUNK = 256 * 1024
# Open tunnels at most (each is two sockets and two tasks); more get a 503 at once, so a
# flood of connections cannot take the agent's file descriptors.
MAX_TUNNELS = 8192
# How often open tunnels are checked against `resolve`: one whose sandbox stopped running
# here (paused, killed, its VM gone) is cut. A paused guest sends nothing, not even a reset,
# so a request another replica has open to it would otherwise wait forever.
CHECK_S = 1.0

# sandbox id -> the slot address it is reached at, None unless it runs on this node now.
Resolve = Callable[[str], str | None]


class BadRequest(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass(frozen=True)
class Target:
    sandbox_id: str
    port: int


_REASONS = {
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    407: "Proxy Authentication Required",
    502: "Bad Gateway",
    503: "Service Unavailable",
    504: "Gateway Timeout",
}


def parse_head(head: bytes, token: str) -> Target:
    """The tunnel a request head asks for, once its token is checked; `BadRequest` if not."""
    try:
        text = head.decode("latin-1")
    except UnicodeDecodeError as exc:  # pragma: no cover - latin-1 decodes every byte
        raise BadRequest(400, "the request head is not text") from exc
    lines = text.split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
        raise BadRequest(400, f"not an HTTP/1 request line: {lines[0][:200]!r}")
    method, authority, _ = parts
    if method != "CONNECT":
        raise BadRequest(405, f"only CONNECT is served here, not {method[:20]}")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if not line:
            continue
        name, sep, value = line.partition(":")
        if not sep:
            raise BadRequest(400, f"malformed header line {line[:200]!r}")
        headers[name.strip().lower()] = value.strip()
    if not _authorized(headers.get("proxy-authorization", ""), token):
        raise BadRequest(407, "a valid node token is required (Proxy-Authorization)")
    host, sep, port_text = authority.rpartition(":")
    if not sep or not host or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise BadRequest(400, f"expected <sandbox id>:<port>, got {authority[:200]!r}")
    return Target(host, int(port_text))


def _authorized(value: str, token: str) -> bool:
    scheme, _, credentials = value.partition(" ")
    given = ""
    if scheme.lower() == "bearer":
        given = credentials.strip()
    elif scheme.lower() == "basic":
        try:
            decoded = base64.b64decode(credentials.strip(), validate=True).decode()
        except (binascii.Error, UnicodeDecodeError):
            return False
        given = decoded.partition(":")[2]
    return bool(given) and secrets.compare_digest(given.encode(), token.encode())


def _answer(status: int, message: str) -> bytes:
    body = json.dumps({"code": status, "message": message}).encode()
    return (
        f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}\r\n"
        "Content-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n"
        + ("Proxy-Authenticate: Bearer\r\n" if status == 407 else "")
        + "Connection: close\r\n\r\n"
    ).encode() + body


class DataGateway:
    """`await start()`, then `port` is bound; `await stop()` ends every open tunnel."""

    def __init__(
        self,
        host: str,
        port: int,
        token: str,
        resolve: Resolve,
        *,
        tls: ssl.SSLContext | None = None,
        connect_timeout_s: float = CONNECT_TIMEOUT_S,
        head_timeout_s: float = HEAD_TIMEOUT_S,
        max_tunnels: int = MAX_TUNNELS,
        check_s: float = CHECK_S,
    ) -> None:
        if not token:
            raise ValueError("a data gateway needs the node token")
        self.host = host
        self.port = port
        self._token = token
        self._resolve = resolve
        self._tls = tls
        self._connect_timeout_s = connect_timeout_s
        self._head_timeout_s = head_timeout_s
        self._max_tunnels = max_tunnels
        self._check_s = check_s
        # Open tunnels: their task -> (sandbox id, the address it was joined to).
        self._joined: dict[asyncio.Task[Any], tuple[str, str]] = {}
        self._checker: asyncio.Task[None] | None = None
        self.cut = 0
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        # Tunnels opened since start, and open now (tests and logs read them).
        self.opened = 0
        self.refused = 0

    @property
    def open_tunnels(self) -> int:
        return len(self._tasks)

    async def start(self) -> None:
        self._server = await asyncio.start_server(
            self._serve, self.host, self.port, ssl=self._tls, limit=MAX_HEAD_BYTES
        )
        self.port = self._server.sockets[0].getsockname()[1]
        self._checker = asyncio.create_task(self._check_forever(), name="gateway-check")

    async def stop(self) -> None:
        if self._checker is not None:
            self._checker.cancel()
            await asyncio.gather(self._checker, return_exceptions=True)
            self._checker = None
        if self._server is not None:
            self._server.close()
            self._server = None
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # Python 3.11's start_server logs a handler task that ends cancelled as an error
        # ("Exception in callback"); a tunnel `stop` cuts ends normally instead.
        with contextlib.suppress(asyncio.CancelledError):
            await self._tunnel(reader, writer)

    async def _tunnel(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        upstream: asyncio.StreamWriter | None = None
        try:
            try:
                if len(self._tasks) > self._max_tunnels:
                    raise BadRequest(503, f"{self._max_tunnels} tunnels are open here already")
                target, address, up_reader, upstream = await self._open(reader)
            except BadRequest as refusal:
                self.refused += 1
                writer.write(_answer(refusal.status, refusal.message))
                with contextlib.suppress(OSError, ConnectionError):
                    await asyncio.wait_for(writer.drain(), self._head_timeout_s)
                return
            self.opened += 1
            self._joined[task] = (target.sandbox_id, address)
            writer.write(b"HTTP/1.1 200 Connection Established\r\n\r\n")
            await writer.drain()
            await both_ways(
                stream_flow(reader, upstream, CHUNK), stream_flow(up_reader, writer, CHUNK)
            )
        except (OSError, ConnectionError, asyncio.IncompleteReadError, TimeoutError) as exc:
            log.debug("gateway: tunnel ended: %r", exc)
        finally:
            self._tasks.discard(task)
            self._joined.pop(task, None)
            for w in (upstream, writer):
                if w is not None:
                    w.close()
            for w in (upstream, writer):
                if w is not None:
                    with contextlib.suppress(Exception):
                        await asyncio.wait_for(w.wait_closed(), 2.0)

    async def _check_forever(self) -> None:
        while True:
            await asyncio.sleep(self._check_s)
            self.check_now()

    def cut_sandbox(self, sandbox_id: str) -> None:
        """Cuts every tunnel to `sandbox_id` now: its guest is being replaced at the same
        address (a reset in place), which `check_now` cannot tell from the old one. A
        replica's pooled connection through a kept tunnel would reach a guest that never had
        it (a reset, and the request failed)."""
        n = 0
        for task, (joined, _) in list(self._joined.items()):
            if joined == sandbox_id:
                self._joined.pop(task, None)
                task.cancel()
                n += 1
        self.cut += n
        if n:
            log.info("gateway: cut %d tunnel(s) of sandbox %s: it is reset", n, sandbox_id)

    def check_now(self) -> None:
        """Cuts every tunnel whose sandbox no longer runs here at the address it joined."""
        cut: dict[str, int] = {}
        for task, (sandbox_id, address) in list(self._joined.items()):
            try:
                still = self._resolve(sandbox_id) == address
            except Exception:  # a resolver that fails says nothing: keep the tunnel
                log.exception("gateway: resolving %s failed", sandbox_id)
                continue
            if not still:
                self.cut += 1
                cut[sandbox_id] = cut.get(sandbox_id, 0) + 1
                self._joined.pop(task, None)
                task.cancel()
        for sandbox_id, n in sorted(cut.items()):
            log.info("gateway: cut %d tunnel(s) of sandbox %s: it no longer runs here",
                     n, sandbox_id)  # fmt: skip

    async def _open(
        self, reader: asyncio.StreamReader
    ) -> tuple[Target, str, asyncio.StreamReader, asyncio.StreamWriter]:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), self._head_timeout_s)
        except TimeoutError:
            raise BadRequest(400, f"no request head in {self._head_timeout_s:g}s") from None
        except asyncio.LimitOverrunError:
            raise BadRequest(400, f"request head over {MAX_HEAD_BYTES} bytes") from None
        except asyncio.IncompleteReadError:
            raise BadRequest(400, "the connection ended inside the request head") from None
        target = parse_head(head[:-4], self._token)
        address = self._resolve(target.sandbox_id)
        if address is None:
            raise BadRequest(404, f"sandbox {target.sandbox_id} does not run on this node")
        try:
            up_reader, upstream = await asyncio.wait_for(
                asyncio.open_connection(address, target.port, limit=CHUNK),
                self._connect_timeout_s,
            )
        except TimeoutError:
            raise BadRequest(
                504,
                f"port {target.port} of sandbox {target.sandbox_id} did not accept in "
                f"{self._connect_timeout_s:g}s",
            ) from None
        except OSError as exc:
            raise BadRequest(
                502, f"port {target.port} of sandbox {target.sandbox_id} is not open: {exc}"
            ) from None
        return target, address, up_reader, upstream
