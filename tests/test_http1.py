"""The proxy's HTTP/1.1 client (`agentenv.http1`) against loopback servers written to answer
what envd never does: bodies that end at the close, informational answers, a HEAD with a
length, idle connections the server drops, chunked uploads and targets that need escaping."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from agentenv.http1 import Broken, Unreachable, UpstreamPool, request_head

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def _serve(handler: Handler) -> tuple[asyncio.Server, UpstreamPool, list[int]]:
    """A server on a free loopback port, a pool to it, and the count of connections made."""
    accepted = [0]

    async def counted(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted[0] += 1
        try:
            await handler(reader, writer)
        finally:
            writer.close()

    server = await asyncio.start_server(counted, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, UpstreamPool(lambda: asyncio.open_connection("127.0.0.1", port)), accepted


async def _request(
    pool: UpstreamPool, method: str, target: str, body: bytes | None = None
) -> tuple[int, bytes]:
    headers = [(b"host", b"guest")]
    if body is not None:
        headers.append((b"content-length", str(len(body)).encode()))
    exchange = await pool.exchange(
        bytes(request_head(method, target, headers)) + (body or b""), head_request=method == "HEAD"
    )
    try:
        await exchange.response()
        return exchange.status, b"".join([c async for c in exchange.body()])
    finally:
        exchange.release()


async def _head(reader: asyncio.StreamReader) -> list[bytes]:
    return (await reader.readuntil(b"\r\n\r\n")).split(b"\r\n")


async def _request_lines(reader: asyncio.StreamReader) -> AsyncIterator[bytes]:
    """The request line of each request on a connection, until the client closes it."""
    while True:
        try:
            yield (await _head(reader))[0]
        except asyncio.IncompleteReadError:
            return


async def test_keep_alive_reuse_until_close_bodies_and_a_dropped_idle_connection() -> None:
    targets: list[bytes] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        async for line in _request_lines(reader):
            targets.append(line.split(b" ")[1])
            if b"/old" in line:
                # HTTP/1.0 style: no length, the body ends when the server closes.
                writer.write(b"HTTP/1.1 200 OK\r\n\r\nuntil the close")
                return
            if b"/extra" in line:
                # More than one answer to one request: the second is not the next one's.
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 1\r\n\r\n1")
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 1\r\n\r\n2")
                await writer.drain()
                continue
            if b"/drop" in line:
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
                await writer.drain()
                return  # then closes: the pool must not reuse this connection
            writer.write(b"HTTP/1.1 103 Early Hints\r\nlink: </a>\r\n\r\n")
            writer.write(b"HTTP/1.1 200 OK\r\nx-n: 1\r\ncontent-length: 5\r\n\r\n")
            if not line.startswith(b"HEAD"):
                writer.write(b"hello")

    server, pool, accepted = await _serve(handler)
    async with server:
        for _ in range(5):
            assert await _request(pool, "GET", "/a") == (200, b"hello")
        assert accepted[0] == 1, "sequential requests share one kept-alive connection"
        assert await _request(pool, "HEAD", "/a") == (200, b""), "a HEAD's length has no body"
        assert await _request(pool, "GET", "/old") == (200, b"until the close")
        before = accepted[0]  # /old's connection is closed: /extra needs a new one
        assert await _request(pool, "GET", "/extra") == (200, b"1")
        assert await _request(pool, "GET", "/a") == (200, b"hello")
        assert accepted[0] == before + 2, "a connection that said too much is not reused"
        assert await _request(pool, "GET", "/drop") == (200, b"ok")
        # At once, maybe before the loop has seen the server's close: sent again on a new
        # connection if the kept one turns out closed.
        assert await _request(pool, "GET", "/a") == (200, b"hello")
        assert await _request(pool, "GET", "/drop") == (200, b"ok")
        await asyncio.sleep(0.05)  # the close has reached the idle connection
        assert await _request(pool, "POST", "/a", b"x") == (200, b"hello")
        # A decoded path (what routing hands on without a raw one) goes out escaped.
        assert await _request(pool, "GET", "/a b/ü?q=1") == (200, b"hello")
        assert targets[-1] == b"/a%20b/%C3%BC?q=1"
        # A query goes on byte for byte, as the client's request line held it.
        head = request_head("GET", "/q", [(b"host", b"guest")], b"k=%C3%BC&raw=\xc3\xbc")
        exchange = await pool.exchange(bytes(head))
        try:
            await exchange.response()
            assert b"".join([c async for c in exchange.body()]) == b"hello"
        finally:
            exchange.release()
        assert targets[-1] == b"/q?k=%C3%BC&raw=\xc3\xbc"
        await pool.aclose()
        await asyncio.sleep(0)


async def test_chunked_upload_and_errors() -> None:
    got: list[bytes] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await _head(reader)
        if b"/garbage" in head[0]:
            writer.write(b"SSH-2.0-not-http\r\n\r\n")
            await writer.drain()
            return
        body = b""
        while True:
            size = int((await reader.readline()).strip(), 16)
            chunk = await reader.readexactly(size + 2)
            if size == 0:
                break
            body += chunk[:-2]
        got.append(body)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%b" % (len(body), body))
        await writer.drain()

    server, pool, _ = await _serve(handler)
    async with server:

        async def parts() -> AsyncIterator[bytes]:
            for part in (b"one ", b"two ", b"three"):
                await asyncio.sleep(0)
                yield part

        head = request_head("POST", "/up", [(b"transfer-encoding", b"chunked")])
        exchange = await pool.exchange(bytes(head))
        try:
            await exchange.send_body(parts(), chunked=True)
            await exchange.response()
            assert b"".join([c async for c in exchange.body()]) == b"one two three"
        finally:
            exchange.release()
        assert got == [b"one two three"]
        with pytest.raises(Broken, match="not an HTTP answer"):
            await _request(pool, "GET", "/garbage")
        await pool.aclose()
    # Nothing listens: a clear refusal at once.
    with pytest.raises(Unreachable):
        await _request(pool, "GET", "/")
    closed = UpstreamPool(lambda: asyncio.open_connection("127.0.0.1", 1))
    with pytest.raises(Unreachable):
        await _request(closed, "GET", "/")


async def test_many_at_once_share_a_bounded_set_of_connections() -> None:
    """60 concurrent requests over at most 8 connections: every one answered, in its own
    order; beyond the bound a request waits, and one that waits too long is told why."""
    release = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        async for line in _request_lines(reader):
            if b"/hold" in line:
                await release.wait()
            body = line.split(b" ")[1]
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%b" % (len(body), body))
            await writer.drain()

    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        pool = UpstreamPool(
            lambda: asyncio.open_connection("127.0.0.1", port),
            max_connections=8,
            pool_timeout_s=0.3,
        )
        answers = await asyncio.gather(*(_request(pool, "GET", f"/r{i}") for i in range(60)))
        assert answers == [(200, f"/r{i}".encode()) for i in range(60)]
        assert len(pool._idle) <= 8 and not pool._busy
        held = [asyncio.create_task(_request(pool, "GET", f"/hold{i}")) for i in range(8)]
        await asyncio.sleep(0.05)
        with pytest.raises(Unreachable, match=r"all 8 connections stayed busy for 0\.3s"):
            await _request(pool, "GET", "/late")
        release.set()
        assert [await t for t in held] == [(200, f"/hold{i}".encode()) for i in range(8)]
        await pool.aclose()
        await asyncio.sleep(0)
