"""The proxy's way to a sandbox on a cluster node: through that node's data gateway.

No VM: real loopback servers stand in for the guest's ports (plain HTTP, HTTP behind TLS for
`httpsPorts`, a WebSocket echo), a real `DataGateway` stands in for the node, and the proxy
serves through uvicorn. The sandbox's record names an address where nothing listens, so only
the tunnel can reach it; a record without a node goes to its address directly, as on one server.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from websockets.asyncio.client import connect as ws_connect
from websockets.asyncio.server import ServerConnection, serve
from websockets.exceptions import ConnectionClosed

from agentenv.control.metrics import Metrics
from agentenv.control.store import SandboxRecord, SandboxState
from agentenv.gateway.client import GatewayDialer
from agentenv.gateway.server import DataGateway
from agentenv.proxy.forward import SandboxProxy
from agentenv.proxy.routing import Sandbox

TOKEN = "node-token"
# On loopback, but no guest server listens there (they bind 127.0.0.1 only): dialled
# directly it refuses, so only the tunnel reaches the guest (and nothing leaves the host).
NOWHERE = "127.0.0.2"


async def _guest_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    size = 0
    while True:
        msg = await receive()
        size += len(msg.get("body", b""))
        if not msg.get("more_body"):
            break
    host = dict(scope["headers"]).get(b"host", b"").decode()
    body = json.dumps({"path": scope["path"], "got": size, "host": host,
                       "tls": scope["scheme"] == "https"}).encode()  # fmt: skip
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": body})


async def _serve(app: Any, **tls: Any) -> tuple[uvicorn.Server, asyncio.Task[None], int]:
    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning",
                            lifespan="off", **tls)  # fmt: skip
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    async with asyncio.timeout(10):
        while not server.started:  # noqa: ASYNC110
            await asyncio.sleep(0.02)
    return server, task, server.servers[0].sockets[0].getsockname()[1]


@dataclass
class Setup:
    proxy_url: str
    http_port: int
    https_port: int
    ws_port: int
    metrics: Metrics
    records: dict[str, SandboxRecord]
    gateway: DataGateway


def _record(sandbox_id: str, address: str, node_id: str | None, https_port: int) -> SandboxRecord:
    now = time.time()
    return SandboxRecord(
        id=sandbox_id, template="base", alias="base", state=SandboxState.RUNNING,
        started_at=now, end_at=now + 600, cpu=1, memory_mb=512, disk_mb=1024,
        envd_version="0.0.0", network={"httpsPorts": [https_port]}, address=address,
        node_id=node_id,
    )  # fmt: skip


@pytest.fixture(scope="module")
def guest_cert(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    out = tmp_path_factory.mktemp("guest-tls")
    cert, key = out / "cert.pem", out / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256",
         "-nodes", "-days", "1", "-subj", "/CN=guest", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True, timeout=30,
    )  # fmt: skip
    return cert, key


@pytest.fixture
async def setup(guest_cert: tuple[Path, Path]) -> AsyncIterator[Setup]:
    cert, key = guest_cert
    servers = []
    plain = await _serve(_guest_app)
    secure = await _serve(_guest_app, ssl_certfile=str(cert), ssl_keyfile=str(key))
    servers += [plain, secure]

    async def echo(ws: ServerConnection) -> None:
        with contextlib.suppress(ConnectionClosed):
            async for message in ws:
                await ws.send(message)

    ws_server = await serve(echo, "127.0.0.1", 0)
    ws_port = ws_server.sockets[0].getsockname()[1] if ws_server.sockets else 0
    running = {"remote": "127.0.0.1"}
    gateway = DataGateway("127.0.0.1", 0, TOKEN, running.get)
    await gateway.start()
    metrics = Metrics()
    records = {
        "remote": _record("remote", NOWHERE, "node-b", secure[2]),
        "local": _record("local", "127.0.0.1", None, secure[2]),
    }

    async def resolve(sandbox_id: str) -> SandboxRecord | None:
        return records.get(sandbox_id)

    async def gateway_of(node_id: str) -> str | None:
        return f"127.0.0.1:{gateway.port}" if node_id == "node-b" else None

    tunnels = metrics.proxy_tunnels
    proxy = SandboxProxy(
        resolve,
        metrics,
        gateway_of=gateway_of,
        dialer=GatewayDialer(TOKEN, on_tunnel=lambda g: tunnels.labels(g).inc()),
    )

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        headers = {k.decode(): v.decode() for k, v in scope.get("headers", [])}
        target = Sandbox(headers["x-sandbox"], int(headers["x-port"]), scope["path"])
        if scope["type"] == "http":
            await proxy.http(scope, receive, send, target)
        elif scope["type"] == "websocket":
            await proxy.websocket(scope, receive, send, target)

    front = await _serve(app)
    servers.append(front)
    try:
        yield Setup(f"http://127.0.0.1:{front[2]}", plain[2], secure[2], ws_port, metrics,
                    records, gateway)  # fmt: skip
    finally:
        await proxy.close()
        for server, task, _ in servers:
            server.should_exit = True
            await task
        ws_server.close()
        await gateway.stop()


def _tunnels(metrics: Metrics) -> float:
    total = 0.0
    for family in metrics.registry.collect():
        if family.name == "agentenv_proxy_tunnels":
            total += sum(s.value for s in family.samples if s.name.endswith("_total"))
    return total


async def test_http_https_and_websockets_reach_a_remote_node_only_through_its_gateway(
    setup: Setup,
) -> None:
    async with httpx.AsyncClient(base_url=setup.proxy_url, timeout=20) as client:
        remote = {"x-sandbox": "remote", "x-port": str(setup.http_port)}
        r = await client.get("/hello", headers=remote)
        assert r.status_code == 200, r.text
        assert r.json()["path"] == "/hello" and not r.json()["tls"]
        body = os.urandom(2 * 1024 * 1024)
        r = await client.post("/up", headers=remote, content=body)
        assert r.json()["got"] == len(body)
        # `httpsPorts`: the guest's own TLS, inside the tunnel.
        r = await client.get("/secure", headers={**remote, "x-port": str(setup.https_port)})
        assert r.status_code == 200 and r.json()["tls"] is True, r.text
        through = _tunnels(setup.metrics)
        assert through >= 2 and setup.gateway.opened == through
        # One server's record (no node): straight to its address, no tunnel.
        local = {"x-sandbox": "local", "x-port": str(setup.http_port)}
        r = await client.get("/direct", headers=local)
        assert r.status_code == 200 and r.json()["path"] == "/direct"
        assert _tunnels(setup.metrics) == through
    url = setup.proxy_url.replace("http://", "ws://") + "/ws"
    headers = {"x-sandbox": "remote", "x-port": str(setup.ws_port)}
    async with ws_connect(url, additional_headers=headers, open_timeout=10) as ws:
        await ws.send("over the tunnel")
        assert await ws.recv() == "over the tunnel"
        big = os.urandom(500_000)
        await ws.send(big)
        assert await ws.recv() == big
    assert _tunnels(setup.metrics) == through + 1


async def test_a_sandbox_the_node_no_longer_runs_is_a_502_with_the_reason(setup: Setup) -> None:
    # The record still says running (another replica paused it a moment ago); the node says
    # it does not run there: the proxy answers at once, naming the port, never hanging.
    setup.records["remote"] = _record("ghost", NOWHERE, "node-b", setup.https_port)
    setup.records["ghost"] = setup.records.pop("remote")
    async with httpx.AsyncClient(base_url=setup.proxy_url, timeout=20) as client:
        t0 = time.monotonic()
        r = await client.get("/x", headers={"x-sandbox": "ghost", "x-port": str(setup.http_port)})
        assert r.status_code == 502 and "port" in r.json()["message"], r.text
        assert time.monotonic() - t0 < 5
    url = setup.proxy_url.replace("http://", "ws://") + "/ws"
    headers = {"x-sandbox": "ghost", "x-port": str(setup.ws_port)}
    with pytest.raises(Exception, match="502"):
        async with ws_connect(url, additional_headers=headers, open_timeout=10):
            pass
