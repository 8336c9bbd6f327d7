"""The HTTP/1.1 client the host speaks to guests with: the proxy to any sandbox port, the
node's envd client to envd. Kept-alive connections to one address (`UpstreamPool`), a
request's head and body written as they are in hand, and the answer parsed by httptools
(llhttp, the C parser uvicorn already uses for the server side) and handed on as it arrives
(`Exchange`); `fetch` for a whole answer.

Why not httpx, the client before: its layers (httpx's request and response models, httpcore's
pool and h11, anyio's streams and cancel scopes) were about half of the server's CPU per
proxied request and ~0.65 ms per request of a kept client on loopback, where this takes
~0.05 (#23, docs/vmm.md); neither user needs what they add (redirects, auth, cookies,
decoding, timeouts per read: callers bound their calls with `asyncio.timeout`). What stays:
a connect deadline, a bound on connections with a deadline to wait for one, idle connections
kept for a while and never reused once their peer has closed them. It sits at the top of the
package (it imports nothing of ours) so the control plane and the node, which may not import
each other, share it."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import NamedTuple
from urllib.parse import quote

import httptools

__all__ = [
    "Broken",
    "Dial",
    "Exchange",
    "Reply",
    "Unreachable",
    "UpstreamPool",
    "fetch",
    "request_head",
]

CONNECT_TIMEOUT_S = 5.0
# How long a request waits for one of a sandbox's MAX_CONNECTIONS to be free.
POOL_TIMEOUT_S = 30.0
MAX_CONNECTIONS = 256
MAX_IDLE = 32
IDLE_EXPIRY_S = 60.0
READ_CHUNK = 256 * 1024
# What a request target may hold unescaped (RFC 3986 pchar, "/", "?" and "%" of escapes
# already there); anything else is percent-encoded before it goes on the request line.
_TARGET_SAFE = "/?%:@!$&'()*+,;=-._~"

# Opens one connection to the sandbox port (directly, or a tunnel through a node's gateway).
Dial = Callable[[], Awaitable[tuple[asyncio.StreamReader, asyncio.StreamWriter]]]


class Unreachable(Exception):
    """No connection to the port: nothing accepts there (or no tunnel), or none was free."""


class Broken(Exception):
    """The connection failed or closed before the answer was whole, or it was not HTTP."""


def request_head(
    method: str, target: str, headers: list[tuple[bytes, bytes]], query: bytes = b""
) -> bytearray:
    """The request line and header block. The headers come from the ASGI server, which
    refused CR and LF in them; the target may be a decoded path (see `raw_target_path`),
    so what a request line cannot hold is escaped. `query` goes on as its bytes came (the
    client's request line held them)."""
    if not target.isascii() or " " in target or not target.isprintable():
        target = quote(target, safe=_TARGET_SAFE)
    out = bytearray(method.encode("latin-1"))
    out += b" "
    out += target.encode("ascii")
    if query:
        out += b"?"
        out += query
    out += b" HTTP/1.1\r\n"
    for name, value in headers:
        out += name
        out += b": "
        out += value
        out += b"\r\n"
    out += b"\r\n"
    return out


class _Answer:
    """httptools' callbacks: the response's status, headers and body as parsed so far."""

    __slots__ = ("body", "done", "head", "headers", "keep_alive", "parser", "status")

    def __init__(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.head = False
        self.body: list[bytes] = []
        self.done = False
        self.keep_alive = False

    def on_message_begin(self) -> None:
        if self.done:
            # Bytes after the whole answer, unasked for: parsed and dropped, and the
            # connection is not used again.
            self.keep_alive = False
            return
        # An informational (1xx) answer comes before the response: its headers are not it.
        self.headers = []

    def on_header(self, name: bytes, value: bytes) -> None:
        if not self.done:
            self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        if status >= 200 and not self.done:
            self.status = status
            self.head = True

    def on_body(self, data: bytes) -> None:
        if not self.done:
            self.body.append(data)

    def on_message_complete(self) -> None:
        if self.head and not self.done:
            self.done = True
            # llhttp answers this only until the message is over.
            self.keep_alive = self.parser.should_keep_alive()

    def until_close(self) -> bool:
        """The body has no length or chunking: it ends when the server closes."""
        for name, value in self.headers:
            low = name.lower()
            if low == b"content-length" or (
                low == b"transfer-encoding" and b"chunked" in value.lower()
            ):
                return False
        return self.status not in (204, 304)


class _Connection:
    __slots__ = ("idle_since", "reader", "writer")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.idle_since = 0.0

    def alive(self) -> bool:
        # The loop feeds a connection's EOF to its reader as soon as the peer closes, so an
        # idle connection its server dropped is seen here before it is used again.
        return not self.writer.is_closing() and not self.reader.at_eof()

    def abort(self) -> None:
        self.writer.transport.abort()


class UpstreamPool:
    """The connections to one sandbox address (one pool per sandbox and slot address)."""

    def __init__(
        self,
        dial: Dial,
        *,
        max_connections: int = MAX_CONNECTIONS,
        pool_timeout_s: float = POOL_TIMEOUT_S,
    ) -> None:
        self._dial = dial
        self._idle: deque[_Connection] = deque()
        self._busy: set[_Connection] = set()
        self._max = max_connections
        self._slots = asyncio.Semaphore(max_connections)
        self._pool_timeout_s = pool_timeout_s
        self._closed = False

    async def exchange(
        self, head: bytes, *, head_request: bool = False, replayable: bool = True
    ) -> Exchange:
        """A connection with the request's `head` (and what body came with it) written,
        ready for the rest of the body and the answer. `Unreachable` if none can be had.
        `replayable`: `head` holds the whole request (no body still to come)."""
        if self._closed:
            raise Unreachable("the sandbox's connections were closed")
        try:
            async with asyncio.timeout(self._pool_timeout_s):
                await self._slots.acquire()
        except TimeoutError:
            raise Unreachable(
                f"all {self._max} connections stayed busy for {self._pool_timeout_s:g}s"
            ) from None
        try:
            conn = self._reuse() or await self._open()
        except BaseException:
            self._slots.release()
            raise
        if self._closed:
            # Closed while this one was connecting: its sandbox is gone (and its address
            # may be another's by now).
            conn.abort()
            self._slots.release()
            raise Unreachable("the sandbox's connections were closed")
        self._busy.add(conn)
        conn.writer.write(head)
        # A kept-alive connection its server closed just now may not show it yet: a request
        # whose whole body is in `head` is sent again on a new one if the old closes before
        # any answer (as browsers do; a server closes an idle connection before reading).
        replay = head if replayable and conn.idle_since else None
        return Exchange(self, conn, head_request, replay)

    def _reuse(self) -> _Connection | None:
        now = time.monotonic()
        while self._idle:
            conn = self._idle.pop()
            if conn.alive() and now - conn.idle_since < IDLE_EXPIRY_S:
                return conn
            conn.writer.close()
        return None

    async def _open(self) -> _Connection:
        try:
            async with asyncio.timeout(CONNECT_TIMEOUT_S):
                reader, writer = await self._dial()
        except TimeoutError:
            raise Unreachable(f"no connection within {CONNECT_TIMEOUT_S:g}s") from None
        except OSError as exc:
            raise Unreachable(str(exc) or repr(exc)) from exc
        return _Connection(reader, writer)

    async def _replace(self, old: _Connection) -> _Connection:
        """A new connection in place of `old` (closed), for the same request."""
        self._busy.discard(old)
        old.abort()
        if self._closed:
            # Closed by the sandbox's release: its address may be another sandbox's by now.
            raise Broken("the sandbox's connections were closed")
        try:
            conn = await self._open()
        except Unreachable as exc:
            # The exchange's release gives the slot back (with `old`, already closed).
            raise Broken(f"reconnecting: {exc}") from exc
        self._busy.add(conn)
        return conn

    def _give_back(self, conn: _Connection, reusable: bool) -> None:
        self._busy.discard(conn)
        self._slots.release()
        if reusable and not self._closed and conn.alive() and len(self._idle) < MAX_IDLE:
            conn.idle_since = time.monotonic()
            self._idle.append(conn)
        else:
            conn.writer.close()

    async def aclose(self) -> None:
        """Close every connection, the busy ones too: their exchanges end as `Broken`."""
        self._closed = True
        for conn in self._busy:
            conn.abort()
        while self._idle:
            self._idle.pop().writer.close()


class Exchange:
    """One request on one connection: the rest of its body, then its answer. `release` (in a
    `finally`) hands the connection back, kept alive only after a whole exchange."""

    def __init__(
        self, pool: UpstreamPool, conn: _Connection, head_request: bool, replay: bytes | None
    ) -> None:
        self._pool = pool
        self._conn = conn
        self._head_request = head_request
        self._replay = replay
        self._answer = _Answer()
        self._sent = True
        self._released = False

    @property
    def status(self) -> int:
        return self._answer.status

    @property
    def headers(self) -> list[tuple[bytes, bytes]]:
        return self._answer.headers

    def abort(self) -> None:
        """Drop the connection now (a cut sandbox, a client gone): a pending read wakes with
        `Broken`, never sent again."""
        self._replay = None
        self._conn.abort()

    async def send_body(self, chunks: AsyncIterator[bytes], *, chunked: bool) -> None:
        """Write the rest of the request body as it comes (`chunked`: framed as chunks, then
        the last chunk). Until it is all written the connection is not reused."""
        self._sent = False
        self._replay = None
        writer = self._conn.writer
        try:
            async for chunk in chunks:
                writer.write(b"%x\r\n%b\r\n" % (len(chunk), chunk) if chunked else chunk)
                await writer.drain()
            if chunked:
                writer.write(b"0\r\n\r\n")
            await writer.drain()
        except OSError as exc:
            raise Broken(f"sending the request body: {exc!r}") from exc
        self._sent = True

    async def response(self) -> None:
        """Until the answer's status and headers are in."""
        try:
            await self._conn.writer.drain()
        except OSError as exc:
            raise Broken(f"sending the request: {exc!r}") from exc
        while not self._answer.head:
            try:
                more = await self._read()
            except Broken:
                if self._replay is None:
                    raise
                more = False
            if more:
                self._replay = None
            elif self._replay is not None:
                await self._again(self._replay)
                self._replay = None
            else:
                raise Broken("the connection closed before an answer")

    async def _again(self, request: bytes) -> None:
        old = self._conn
        self._conn = await self._pool._replace(old)
        self._answer = _Answer()
        self._conn.writer.write(request)
        try:
            await self._conn.writer.drain()
        except OSError as exc:
            raise Broken(f"sending the request: {exc!r}") from exc

    async def body(self) -> AsyncIterator[bytes]:
        """The body as it arrives, one piece per read from the connection."""
        answer = self._answer
        if self._head_request:
            # Its Content-Length says what a GET would get; nothing follows on the wire.
            answer.body = []
            answer.done = True
        while True:
            if answer.body:
                chunk = answer.body[0] if len(answer.body) == 1 else b"".join(answer.body)
                answer.body = []
                yield chunk
            if answer.done:
                return
            if not await self._read():
                if answer.until_close():
                    answer.done = True
                    continue
                raise Broken("the connection closed before the body's end")

    async def _read(self) -> bool:
        try:
            data = await self._conn.reader.read(READ_CHUNK)
        except OSError as exc:
            raise Broken(repr(exc)) from exc
        if not data:
            return False
        try:
            self._answer.parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as exc:
            # An upgrade (101) is no answer to a plain request either: WebSockets go their
            # own way (`websocket`).
            raise Broken(f"not an HTTP answer: {exc!r}") from exc
        return True

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        answer = self._answer
        reusable = self._sent and answer.done and not self._head_request and answer.keep_alive
        with contextlib.suppress(Exception):
            self._pool._give_back(self._conn, reusable)


class Reply(NamedTuple):
    """A whole answer."""

    status: int
    headers: list[tuple[bytes, bytes]]
    content: bytes


async def fetch(pool: UpstreamPool, request: bytes) -> Reply:
    """Send `request` (head and whole body) and read the whole answer."""
    exchange = await pool.exchange(request)
    try:
        await exchange.response()
        content = b"".join([chunk async for chunk in exchange.body()])
        return Reply(exchange.status, exchange.headers, content)
    finally:
        exchange.release()
