"""The data-plane proxy against real upstreams: a user HTTP server and a WebSocket echo server
running in a microVM sandbox, and envd itself."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from api.conftest import stored_row
from e2b import Sandbox
from websockets.asyncio.client import connect as ws_connect
from websockets.exceptions import InvalidStatus

from agentenv.api.devserver import ServerProcess

from .conftest import (
    TLS_HTTP_PORT,
    TLS_WS_PORT,
    Guest,
    sdk_opts,
    self_signed,
    start_app,
    wait_port,
)

pytestmark = pytest.mark.vm


@pytest.fixture
def client(guest: Guest) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=guest.server.url, timeout=30) as c:
        yield c


def test_header_routing_strips_routing_headers(client: httpx.Client, guest: Guest) -> None:
    resp = client.get(
        "/echo?x=1", headers={**guest.headers(), "e2b-traffic-access-token": "t", "x-mine": "1"}
    )
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["path"] == "/echo?x=1"
    assert body["headers"]["x-mine"] == "1"
    for h in ("e2b-sandbox-id", "e2b-sandbox-port", "e2b-traffic-access-token"):
        assert h not in body["headers"]
    # A guest's Set-Cookie reaches the client as is, and the proxy's own client to the
    # sandbox keeps none of it (no jar: `agentenv.http1`): a request without
    # cookies arrives without any.
    with httpx.Client(base_url=guest.server.url, timeout=30) as fresh:
        set_one = fresh.get("/echo?cookie=1", headers=guest.headers())
        assert set_one.headers.get("set-cookie") == "sid=guest; Path=/"
        bare = httpx.get(f"{guest.server.url}/echo", headers=guest.headers(), timeout=30)
        assert "cookie" not in bare.json()["headers"]


def test_host_and_path_routing(client: httpx.Client, guest: Guest) -> None:
    sid = guest.sandbox.sandbox_id
    by_host = client.get("/a/b", headers={"host": f"{guest.http_port}-{sid}.sbx.test"})
    assert by_host.status_code == 200 and by_host.json()["path"] == "/a/b"
    by_path = client.get(f"/proxy/{sid}/{guest.http_port}/c/d?e=f")
    assert by_path.status_code == 200 and by_path.json()["path"] == "/c/d?e=f"


def test_escaped_and_non_ascii_paths_reach_the_app_as_sent(
    client: httpx.Client, guest: Guest
) -> None:
    """Percent-escapes are passed on as the client wrote them (as E2B's proxy does): a
    decoded `%2F` would split a segment, `%3F` and `%23` would start a query or fragment."""
    sid = guest.sandbox.sandbox_id
    for raw in ("/files/a%2Fb%3Fc%23d%25e%20f", "/caf%C3%A9/%E6%96%87?q=%E2%9C%93&r=a%2Bb"):
        by_header = client.get(raw, headers=guest.headers())
        assert by_header.status_code == 200, by_header.text
        assert by_header.json()["path"] == raw
        by_path = client.get(f"/proxy/{sid}/{guest.http_port}{raw}")
        assert by_path.status_code == 200, by_path.text
        assert by_path.json()["path"] == raw


def test_streamed_response_arrives_chunk_by_chunk(client: httpx.Client, guest: Guest) -> None:
    arrivals: list[float] = []
    started = time.monotonic()
    with client.stream("GET", "/stream", headers=guest.headers()) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"] == "text/event-stream"
        for line in resp.iter_lines():
            if line.startswith("data:"):
                arrivals.append(time.monotonic() - started)
    assert len(arrivals) == 5
    # The server sleeps 0.4 s between events: buffering would deliver them all at once.
    assert arrivals[-1] - arrivals[0] > 1.2, arrivals


@pytest.mark.parametrize("chunked", [True, False])
def test_large_upload_streams_through(client: httpx.Client, guest: Guest, chunked: bool) -> None:
    block = os.urandom(1 << 20)
    total = 64
    digest = hashlib.sha256(block * total).hexdigest()

    def body() -> Iterator[bytes]:
        for _ in range(total):
            yield block

    headers = guest.headers()
    if not chunked:
        headers["content-length"] = str(total * len(block))
    resp = client.post("/upload", content=body(), headers=headers, timeout=120)
    assert resp.status_code == 200, resp.text
    assert resp.json() == {"sha256": digest, "bytes": total * len(block)}


def test_websocket_passthrough(guest: Guest) -> None:
    async def run() -> None:
        url = guest.server.url.replace("http://", "ws://") + "/"
        async with ws_connect(url, additional_headers=guest.headers(guest.ws_port)) as ws:
            await ws.send("hello")
            assert await ws.recv() == "hello"
            payload = os.urandom(300_000)
            await ws.send(payload)
            assert await ws.recv() == payload
        sid = guest.sandbox.sandbox_id
        # The URI names the sandbox host; the socket still goes to the server on loopback.
        host_url = f"ws://{guest.ws_port}-{sid}.sbx.test:{guest.server.port}/"
        async with ws_connect(host_url, host="127.0.0.1", port=guest.server.port) as ws:
            await ws.send("by host")
            assert await ws.recv() == "by host"
        with pytest.raises(InvalidStatus) as info:
            async with ws_connect(url, additional_headers={"e2b-sandbox-id": "inope"}):
                pass
        assert info.value.response.status_code == 502

    asyncio.run(run())


def test_unknown_sandbox_and_closed_port_are_502(client: httpx.Client, guest: Guest) -> None:
    resp = client.get("/health", headers={"e2b-sandbox-id": "inosuchsandbox"})
    assert resp.status_code == 502
    assert resp.json()["message"] == "The sandbox inosuchsandbox was not found"
    closed = client.get("/x", headers=guest.headers(1))
    assert closed.status_code == 502 and "not open" in closed.json()["message"]


def test_envd_access_token_is_forwarded(client: httpx.Client, guest: Guest) -> None:
    token = guest.sandbox._envd_access_token
    assert token
    url = "/process.Process/List"
    hdrs = {**guest.headers(49983), "content-type": "application/json"}
    assert client.post(url, content=b"{}", headers=hdrs).status_code == 401
    bad = client.post(url, content=b"{}", headers={**hdrs, "x-access-token": "wrong"})
    assert bad.status_code == 401
    ok = client.post(url, content=b"{}", headers={**hdrs, "x-access-token": token})
    assert ok.status_code == 200 and "processes" in ok.json()


def test_traffic_token_required_when_public_traffic_is_off(proxy_server: ServerProcess) -> None:
    sbx = Sandbox.create(
        template="base",
        timeout=120,
        network={"allow_public_traffic": False},
        **sdk_opts(proxy_server),  # type: ignore[arg-type]
    )
    try:
        token = sbx.traffic_access_token
        assert token
        rec = stored_row(proxy_server.home, sbx.sandbox_id)
        assert rec is not None and rec.traffic_token == token
        port = 8000
        sbx.commands.run(
            f"python3 -m http.server {port} --directory /tmp", background=True, timeout=0
        )
        hdrs = {"e2b-sandbox-id": sbx.sandbox_id, "e2b-sandbox-port": str(port)}
        with httpx.Client(base_url=proxy_server.url, timeout=10) as c:
            wait_port(c, {**hdrs, "e2b-traffic-access-token": token})
            assert c.get("/", headers={**hdrs, "e2b-traffic-access-token": token}).status_code < 500
            denied = c.get("/", headers=hdrs)
            assert denied.status_code == 403 and "e2b-traffic-access-token" in denied.text
            wrong = c.get("/", headers={**hdrs, "e2b-traffic-access-token": "x"})
            assert wrong.status_code == 403
            # envd itself needs no traffic token.
            assert sbx.is_running()
    finally:
        sbx.kill()
    with httpx.Client(base_url=proxy_server.url, timeout=10) as c:
        gone = c.get("/", headers=hdrs)
        assert gone.status_code == 502 and "was not found" in gone.text


BODY_SILENCE_S = 7.0


def test_request_body_may_idle(client: httpx.Client, guest: Guest) -> None:
    # The SDK's async stdin keeps its request open and writes a keepalive only every 50 s, so
    # nothing on the path may time a silent request body out. Nothing of ours sets such a
    # limit; the ones a regression would bring are the libraries' defaults (httpx's 5 s
    # timeouts, uvicorn's 5 s keep-alive), so a silence past those catches it without
    # waiting out a minute.
    def body() -> Iterator[bytes]:
        yield b"first "
        time.sleep(BODY_SILENCE_S)
        yield b"second"

    resp = client.post("/idle", content=body(), headers=guest.headers(), timeout=120)
    assert resp.status_code == 200, resp.text
    assert resp.json() == {"sha256": hashlib.sha256(b"first second").hexdigest(), "bytes": 12}


async def ws_headers(server: ServerProcess, headers: dict[str, str]) -> dict[str, str]:
    """The handshake headers the guest's WebSocket server got (its `/headers` path)."""
    url = server.url.replace("http://", "ws://") + "/headers"
    async with asyncio.timeout(30), ws_connect(url, additional_headers=headers) as ws:
        got = json.loads(await ws.recv())
        await ws.send("still echoing")
        assert await ws.recv() == "still echoing"
    return dict(got)


def test_guest_sees_the_clients_host(client: httpx.Client, guest: Guest) -> None:
    # As E2B's proxy (no maskRequestHost): the Host the client sent, over HTTP and WebSocket.
    host = f"127.0.0.1:{guest.server.port}"
    seen = client.get("/echo", headers=guest.headers()).json()["headers"]
    assert seen["host"] == host and "x-forwarded-host" not in seen
    seen = asyncio.run(ws_headers(guest.server, guest.headers(guest.ws_port)))
    assert seen["host"] == host and "x-forwarded-host" not in seen


def test_mask_request_host_and_https_ports(proxy_server: ServerProcess, tmp_path: Path) -> None:
    sbx = Sandbox.create(
        template="base",
        timeout=300,
        network={
            "mask_request_host": "${PORT}-app.example.com",
            "https_ports": [TLS_HTTP_PORT, TLS_WS_PORT],
        },
        **sdk_opts(proxy_server),  # type: ignore[arg-type]
    )
    try:
        g = start_app(proxy_server, sbx, tls=self_signed(tmp_path))
        with httpx.Client(base_url=proxy_server.url, timeout=30) as c:
            info = c.get(
                f"/sandboxes/{sbx.sandbox_id}", headers={"X-API-Key": proxy_server.api_key}
            )
            assert info.json()["network"]["maskRequestHost"] == "${PORT}-app.example.com"
            assert info.json()["network"]["httpsPorts"] == [TLS_HTTP_PORT, TLS_WS_PORT]
            client_host = f"127.0.0.1:{proxy_server.port}"
            for port in (g.http_port, TLS_HTTP_PORT):
                # A client's own X-Forwarded-Host is replaced, as E2B's proxy does.
                hdrs = {**g.headers(port), "x-forwarded-host": "spoofed.example"}
                resp = c.get("/echo", headers=hdrs)
                assert resp.status_code == 200, resp.text
                seen = resp.json()["headers"]
                assert seen["host"] == f"{port}-app.example.com", seen
                assert seen["x-forwarded-host"] == client_host, seen
            # The guest's TLS port refuses plain HTTP, so the 200 above went over TLS.
            with pytest.raises((httpx.HTTPError, OSError)):
                httpx.get(f"http://{g.address}:{TLS_HTTP_PORT}/echo", timeout=5)
            # envd's port is never masked (it has its own access rules).
            assert sbx.is_running()
        for port in (g.ws_port, TLS_WS_PORT):
            seen = asyncio.run(ws_headers(proxy_server, g.headers(port)))
            assert seen["host"] == f"{port}-app.example.com", seen
            assert seen["x-forwarded-host"] == f"127.0.0.1:{proxy_server.port}", seen
    finally:
        sbx.kill()
