"""The data gateway on loopback, with real HTTP and WebSocket servers standing in for guests:
tunnels carry keep-alive HTTP, large bodies both ways, half-closes and WebSockets; every
refusal is an answer with a reason, never a hang; stopping the gateway cuts what is open."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import ssl
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest
import uvicorn
from noderpc.test_tls import Pki, pki  # noqa: F401 (a fixture)
from websockets.asyncio.client import connect as ws_connect
from websockets.asyncio.server import ServerConnection, serve
from websockets.exceptions import ConnectionClosed

from agentenv.gateway.client import GatewayDialer, TunnelError, TunnelRefused
from agentenv.gateway.server import DataGateway
from agentenv.http1 import Unreachable, UpstreamPool, fetch, request_head

TOKEN = "gateway-test-token"


def _tunnels(dialer: GatewayDialer, gateway: str, sandbox_id: str, port: int) -> UpstreamPool:
    """The proxy's pool over tunnels to one sandbox port, as a cluster replica has it."""

    async def dial() -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        try:
            return await dialer.open(gateway, sandbox_id, port)
        except TunnelError as exc:
            raise Unreachable(str(exc)) from exc

    return UpstreamPool(dial)


async def _fetch(pool: UpstreamPool, path: str, body: bytes | None = None) -> tuple[int, bytes]:
    method = "GET" if body is None else "POST"
    headers = [(b"host", b"x")]
    if body is not None:
        headers.append((b"content-length", str(len(body)).encode()))
    reply = await fetch(pool, bytes(request_head(method, path, headers)) + (body or b""))
    return reply.status, reply.content


async def _app(scope: dict, receive, send) -> None:  # type: ignore[no-untyped-def,type-arg]
    """Echoes a request's body and says how many bytes it got; /big answers 8 MiB."""
    if scope["type"] != "http":
        return
    body = b""
    while True:
        msg = await receive()
        body += msg.get("body", b"")
        if not msg.get("more_body"):
            break
    if scope["path"] == "/big":
        payload = bytes(range(256)) * (32 * 1024)
    else:
        payload = json.dumps({"path": scope["path"], "got": len(body)}).encode()
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": payload})


@dataclass
class Guests:
    http_port: int
    ws_port: int
    echo_port: int
    closed_port: int


@pytest.fixture
async def guests() -> AsyncIterator[Guests]:
    config = uvicorn.Config(_app, host="127.0.0.1", port=0, log_level="warning", lifespan="off")
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    while not server.started:  # noqa: ASYNC110
        await asyncio.sleep(0.02)
    http_port = server.servers[0].sockets[0].getsockname()[1]

    async def echo_ws(ws: ServerConnection) -> None:
        with contextlib.suppress(ConnectionClosed):  # a cut tunnel ends it so
            async for message in ws:
                await ws.send(message)

    async def echo_to_eof(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # Answers only once the client has half-closed: what a tunnel must pass on.
        data = await reader.read()
        writer.write(b"got " + str(len(data)).encode())
        await writer.drain()
        writer.close()

    ws_server = await serve(echo_ws, "127.0.0.1", 0)
    echo = await asyncio.start_server(echo_to_eof, "127.0.0.1", 0)
    probe = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    closed_port = probe.sockets[0].getsockname()[1]
    probe.close()
    await probe.wait_closed()
    try:
        yield Guests(
            http_port,
            ws_server.sockets[0].getsockname()[1] if ws_server.sockets else 0,
            echo.sockets[0].getsockname()[1],
            closed_port,
        )
    finally:
        server.should_exit = True
        await task
        ws_server.close()
        echo.close()


def _resolve(sandbox_id: str) -> str | None:
    return "127.0.0.1" if sandbox_id == "sbx1" else None


@pytest.fixture
async def gateway() -> AsyncIterator[DataGateway]:
    gw = DataGateway("127.0.0.1", 0, TOKEN, _resolve, connect_timeout_s=2.0, head_timeout_s=2.0)
    await gw.start()
    try:
        yield gw
    finally:
        await gw.stop()


def _address(gw: DataGateway) -> str:
    return f"127.0.0.1:{gw.port}"


async def test_http_through_a_tunnel_keeps_its_connection_and_carries_big_bodies(
    guests: Guests, gateway: DataGateway
) -> None:
    # The tunnel goes where the gateway says sbx1 is: no address of ours is dialled.
    pool = _tunnels(GatewayDialer(TOKEN), _address(gateway), "sbx1", guests.http_port)
    try:
        for i in range(20):
            status, got = await _fetch(pool, f"/n{i}")
            assert status == 200 and json.loads(got) == {"path": f"/n{i}", "got": 0}
        assert gateway.opened == 1, "keep-alive: one tunnel for sequential requests"
        up = bytes(7) * (3 * 1024 * 1024)
        status, got = await _fetch(pool, "/up", up)
        assert status == 200 and json.loads(got)["got"] == len(up)
        status, got = await _fetch(pool, "/big")
        assert status == 200 and got == bytes(range(256)) * (32 * 1024)
        answers = await asyncio.gather(*(_fetch(pool, f"/c{i}") for i in range(40)))
        assert [json.loads(a[1])["path"] for a in answers] == [f"/c{i}" for i in range(40)]
        assert 1 < gateway.opened <= 41
    finally:
        await pool.aclose()
    deadline = time.monotonic() + 5
    while gateway.open_tunnels and time.monotonic() < deadline:  # noqa: ASYNC110
        await asyncio.sleep(0.05)
    assert gateway.open_tunnels == 0, "a closed pool leaves no tunnel open on the node"


async def _raw(gw: DataGateway, request: bytes) -> tuple[int, dict[str, object]]:
    reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
    try:
        writer.write(request)
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(), 5)
    finally:
        writer.close()
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split(b" ")[1]), json.loads(body)


async def test_every_refusal_is_an_answer_with_its_reason(
    guests: Guests, gateway: DataGateway
) -> None:
    good = f"Proxy-Authorization: Bearer {TOKEN}\r\n"
    cases = [
        (f"CONNECT sbx1:{guests.http_port} HTTP/1.1\r\n\r\n", 407, "node token"),
        (
            f"CONNECT sbx1:{guests.http_port} HTTP/1.1\r\nProxy-Authorization: Bearer no\r\n\r\n",
            407,
            "node token",
        ),
        (f"GET / HTTP/1.1\r\n{good}\r\n", 405, "only CONNECT"),
        ("hello\r\n\r\n", 400, "request line"),
        (f"CONNECT sbx1 HTTP/1.1\r\n{good}\r\n", 400, "<sandbox id>:<port>"),
        (f"CONNECT sbx1:70000 HTTP/1.1\r\n{good}\r\n", 400, "<sandbox id>:<port>"),
        (f"CONNECT other:{guests.http_port} HTTP/1.1\r\n{good}\r\n", 404, "does not run"),
        (f"CONNECT sbx1:{guests.closed_port} HTTP/1.1\r\n{good}\r\n", 502, "is not open"),
    ]
    for request, status, words in cases:
        got, body = await _raw(gateway, request.encode())
        assert (got, body["code"]) == (status, status), request
        assert words in str(body["message"]), (request, body)
    # Basic, as generic CONNECT clients send a password, is the token too.
    basic = base64.b64encode(f"any:{TOKEN}".encode()).decode()
    reader, writer = await asyncio.open_connection("127.0.0.1", gateway.port)
    writer.write(
        f"CONNECT sbx1:{guests.http_port} HTTP/1.1\r\nProxy-Authorization: Basic {basic}\r\n\r\n"
        f"GET /basic HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode()
    )
    answer = await asyncio.wait_for(reader.read(), 5)
    writer.close()
    assert answer.startswith(b"HTTP/1.1 200 Connection Established\r\n\r\nHTTP/1.1 200")
    assert b'"/basic"' in answer
    # A client that never finishes its head is answered within the head deadline.
    reader, writer = await asyncio.open_connection("127.0.0.1", gateway.port)
    writer.write(b"CONNECT sbx1:1 HTTP/1.1\r\n")
    t0 = time.monotonic()
    answer = await asyncio.wait_for(reader.read(), 5)
    writer.close()
    assert answer.startswith(b"HTTP/1.1 400") and time.monotonic() - t0 < 4
    # Through the dialer: typed refusals, and the proxy's pool sees a failed connect.
    with pytest.raises(TunnelRefused) as refused:
        await GatewayDialer("wrong").open(_address(gateway), "sbx1", guests.http_port)
    assert refused.value.status == 407
    pool = _tunnels(GatewayDialer(TOKEN), _address(gateway), "gone", guests.http_port)
    with pytest.raises(Unreachable, match="404 sandbox gone does not run"):
        await _fetch(pool, "/")
    # Nothing listening at the gateway's address: a connect error at once, not a hang.
    t0 = time.monotonic()
    with pytest.raises(TunnelError, match="unreachable"):
        await GatewayDialer(TOKEN).open(f"127.0.0.1:{guests.closed_port}", "sbx1", 1)
    assert time.monotonic() - t0 < 2


async def test_a_half_close_reaches_the_guest_and_its_answer_comes_back(
    guests: Guests, gateway: DataGateway
) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", gateway.port)
    writer.write(
        f"CONNECT sbx1:{guests.echo_port} HTTP/1.1\r\nProxy-Authorization: Bearer {TOKEN}"
        "\r\n\r\n".encode()
    )
    assert await reader.readuntil(b"\r\n\r\n") == b"HTTP/1.1 200 Connection Established\r\n\r\n"
    writer.write(b"x" * 100_000)
    writer.write_eof()
    assert await asyncio.wait_for(reader.read(), 5) == b"got 100000"
    writer.close()


async def test_websockets_through_a_tunnel_socket(guests: Guests, gateway: DataGateway) -> None:
    dialer = GatewayDialer(TOKEN)

    async def one(i: int) -> None:
        sock, relay = await dialer.socket(_address(gateway), "sbx1", guests.ws_port)
        async with ws_connect(
            f"ws://sandbox-{i}.example:{guests.ws_port}/", sock=sock, open_timeout=5
        ) as ws:
            for n in range(5):
                await ws.send(f"{i}-{n}")
                assert await ws.recv() == f"{i}-{n}"
            await ws.send(b"\x00" * 1_000_000)
            assert await ws.recv() == b"\x00" * 1_000_000
        await asyncio.wait_for(relay, 5)

    await asyncio.gather(*(one(i) for i in range(12)))
    assert gateway.opened == 12
    deadline = time.monotonic() + 5
    while gateway.open_tunnels and time.monotonic() < deadline:  # noqa: ASYNC110
        await asyncio.sleep(0.05)
    assert gateway.open_tunnels == 0


async def test_stopping_the_gateway_cuts_open_tunnels(guests: Guests) -> None:
    gw = DataGateway("127.0.0.1", 0, TOKEN, _resolve)
    await gw.start()
    sock, relay = await GatewayDialer(TOKEN).socket(_address(gw), "sbx1", guests.ws_port)
    ws = await ws_connect(f"ws://x:{guests.ws_port}/", sock=sock, open_timeout=5)
    await ws.send("before")
    assert await ws.recv() == "before"
    assert gw.open_tunnels == 1
    await asyncio.wait_for(gw.stop(), 5)
    await asyncio.wait_for(relay, 5)
    with pytest.raises(ConnectionClosed):
        await asyncio.wait_for(ws.recv(), 5)
    await ws.close()


async def test_a_tls_gateway_is_verified_and_carries_the_same_traffic(
    guests: Guests,
    pki: Pki,  # noqa: F811
) -> None:
    server_tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_tls.load_cert_chain(pki.cert, pki.key)
    gw = DataGateway("127.0.0.1", 0, TOKEN, _resolve, tls=server_tls)
    await gw.start()
    try:
        trusted = ssl.create_default_context(cafile=str(pki.ca))
        address = "tls://" + _address(gw)
        pool = _tunnels(GatewayDialer(TOKEN, trusted), address, "sbx1", guests.http_port)
        status, got = await _fetch(pool, "/tls", b"abc")
        assert status == 200 and json.loads(got) == {"path": "/tls", "got": 3}
        await pool.aclose()
        sock, relay = await GatewayDialer(TOKEN, trusted).socket(address, "sbx1", guests.ws_port)
        async with ws_connect(f"ws://x:{guests.ws_port}/", sock=sock, open_timeout=5) as ws:
            await ws.send("over tls")
            assert await ws.recv() == "over tls"
        await asyncio.wait_for(relay, 5)
        # Another CA's certificate is refused, never used unverified.
        other = ssl.create_default_context(cafile=str(pki.other_ca))
        with pytest.raises(TunnelError, match=r"CERTIFICATE_VERIFY_FAILED|certificate verify"):
            await GatewayDialer(TOKEN, other).open(address, "sbx1", guests.http_port)
        # Plain TCP to a TLS gateway is no tunnel either.
        with pytest.raises(TunnelError):
            await GatewayDialer(TOKEN).open(_address(gw), "sbx1", guests.http_port)
        assert gw.opened == 2
    finally:
        await gw.stop()


async def test_tunnels_beyond_the_cap_are_refused_at_once(guests: Guests) -> None:
    gw = DataGateway("127.0.0.1", 0, TOKEN, _resolve, max_tunnels=3)
    await gw.start()
    dialer = GatewayDialer(TOKEN)
    held = []
    try:
        for _ in range(3):
            held.append(await dialer.socket(_address(gw), "sbx1", guests.ws_port))
        with pytest.raises(TunnelRefused) as refused:
            await dialer.open(_address(gw), "sbx1", guests.ws_port)
        assert refused.value.status == 503 and "3 tunnels" in refused.value.message
        # One closed, one more fits.
        sock, relay = held.pop()
        sock.close()
        await asyncio.wait_for(relay, 5)
        deadline = time.monotonic() + 5
        while gw.open_tunnels >= 3 and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.05)
        held.append(await dialer.socket(_address(gw), "sbx1", guests.ws_port))
    finally:
        for sock, relay in held:
            sock.close()
            relay.cancel()
        await gw.stop()


async def test_a_sandbox_that_stops_running_here_has_its_tunnels_cut(guests: Guests) -> None:
    """Paused or killed on this node (the resolver no longer knows it): its open tunnels end
    within a check, so a request through another replica does not wait on a frozen guest."""
    running = {"sbx1": "127.0.0.1", "sbx2": "127.0.0.1"}
    gw = DataGateway("127.0.0.1", 0, TOKEN, running.get, check_s=0.2)
    await gw.start()
    dialer = GatewayDialer(TOKEN)
    try:
        socks = {}
        for sid in running:
            socks[sid] = await dialer.socket(_address(gw), sid, guests.ws_port)
        ws1 = await ws_connect(f"ws://x:{guests.ws_port}/", sock=socks["sbx1"][0], open_timeout=5)
        ws2 = await ws_connect(f"ws://x:{guests.ws_port}/", sock=socks["sbx2"][0], open_timeout=5)
        del running["sbx1"]
        t0 = time.monotonic()
        with pytest.raises(ConnectionClosed):
            await asyncio.wait_for(ws1.recv(), 5)
        assert time.monotonic() - t0 < 2 and gw.cut == 1
        # The other sandbox's tunnel is untouched.
        await ws2.send("still here")
        assert await ws2.recv() == "still here"
        # Back at another address (resumed elsewhere on this node): cut as well.
        running["sbx2"] = "127.0.0.2"
        with pytest.raises(ConnectionClosed):
            await asyncio.wait_for(ws2.recv(), 5)
        await ws1.close()
        await ws2.close()
        for _, relay in socks.values():
            await asyncio.wait_for(relay, 5)
    finally:
        await gw.stop()
