"""A real server (local runtime: envd processes on 127.77.x.y) with one sandbox that runs a
user HTTP server and a WebSocket echo server, both real processes started through envd."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from e2b import Sandbox

from agentenv.api.devserver import ServerProcess, free_port
from agentenv.orchestrator.store import Store

APP = r"""
import hashlib, json, sys, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

class H(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def _send(self, body, status=200):
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.path.startswith("/stream"):
            self.send_response(200)
            self.send_header("content-type", "text/event-stream")
            self.send_header("transfer-encoding", "chunked")
            self.end_headers()
            for i in range(5):
                line = f"data: tick {i} {time.time()}\n\n".encode()
                self.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))
                self.wfile.flush()
                time.sleep(0.4)
            self.wfile.write(b"0\r\n\r\n")
            return
        self._send({"path": self.path, "headers": {k.lower(): v for k, v in self.headers.items()}})

    def do_POST(self):
        h = hashlib.sha256()
        n = 0
        if self.headers.get("transfer-encoding", "").lower() == "chunked":
            while True:
                size = int(self.rfile.readline().strip().split(b";")[0], 16)
                if size == 0:
                    self.rfile.readline()
                    break
                chunk = self.rfile.read(size)
                self.rfile.readline()
                h.update(chunk)
                n += len(chunk)
        else:
            left = int(self.headers.get("content-length", "0"))
            while left:
                chunk = self.rfile.read(min(left, 1 << 16))
                h.update(chunk)
                n += len(chunk)
                left -= len(chunk)
        self._send({"sha256": h.hexdigest(), "bytes": n})

    def log_message(self, *a):
        pass

import asyncio, threading
from websockets.asyncio.server import serve

async def echo(ws):
    async for message in ws:
        await ws.send(message)

async def ws_main():
    async with serve(echo, sys.argv[1], int(sys.argv[3]), compression=None, max_size=None):
        await asyncio.Future()

server = ThreadingHTTPServer((sys.argv[1], int(sys.argv[2])), H)
threading.Thread(target=server.serve_forever, daemon=True).start()
asyncio.run(ws_main())
"""


@dataclass
class Guest:
    server: ServerProcess
    sandbox: Sandbox
    address: str
    http_port: int
    ws_port: int

    def headers(self, port: int | None = None) -> dict[str, str]:
        return {
            "e2b-sandbox-id": self.sandbox.sandbox_id,
            "e2b-sandbox-port": str(port or self.http_port),
        }


@pytest.fixture(scope="module")
def proxy_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    srv = ServerProcess(tmp_path_factory.mktemp("proxy-home"), runtime="local").start()
    try:
        yield srv
    finally:
        srv.stop()


def sdk_opts(server: ServerProcess) -> dict[str, str]:
    return {"api_key": server.api_key, "api_url": server.url, "sandbox_url": server.url}


def wait_port(client: httpx.Client, guest_headers: dict[str, str], path: str = "/") -> None:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        resp = client.get(path, headers=guest_headers)
        if resp.status_code != 502:
            return
        time.sleep(0.1)
    raise AssertionError(f"guest port never opened: {resp.text}")


@pytest.fixture(scope="module")
def guest(proxy_server: ServerProcess) -> Iterator[Guest]:
    sbx = Sandbox.create(template="base", timeout=600, **sdk_opts(proxy_server))  # type: ignore[arg-type]
    app_path = f"/tmp/agentenv-proxy-app-{sbx.sandbox_id}.py"
    try:
        rec = Store(proxy_server.home / "agentenv.db").get(sbx.sandbox_id)
        assert rec is not None and rec.address
        http_port, ws_port = free_port(), free_port()
        sbx.files.write(app_path, APP)
        sbx.commands.run(
            f"{sys.executable} {app_path} {rec.address} {http_port} {ws_port}",
            background=True,
            timeout=0,
        )
        g = Guest(proxy_server, sbx, rec.address, http_port, ws_port)
        with httpx.Client(base_url=proxy_server.url, timeout=10) as client:
            wait_port(client, g.headers(), "/ready")
        yield g
    finally:
        sbx.kill()
        # The local runtime's "sandbox" filesystem is the host's.
        Path(app_path).unlink(missing_ok=True)
