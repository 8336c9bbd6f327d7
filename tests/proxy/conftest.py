"""A real server whose sandboxes are microVMs, with one sandbox that runs a user HTTP server
and a WebSocket echo server, both real processes in the guest started through envd.

The guest's Python has no `websockets`; the host venv's copy (pure Python; its optional C
speedups are left out) is uploaded with the app.
"""

from __future__ import annotations

import io
import shutil
import subprocess
import tarfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import websockets
from api.conftest import stored_row
from e2b import Sandbox

from agentenv.api.devserver import ServerProcess
from agentenv.template.datadir import prepare_home

# A create restores a snapshot in about a second, but can boot a VM under emulation.
REQUEST_TIMEOUT_S = 300.0

# Guest ports of the user servers: the guest is a machine of its own, any free port will do.
HTTP_PORT = 8080
WS_PORT = 8081
# The same servers behind TLS (self-signed), for `network.httpsPorts`.
TLS_HTTP_PORT = 8443
TLS_WS_PORT = 8444
GUEST_LIB = "/tmp/agentenv-proxy-lib"

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
        if "cookie=1" in self.path:
            self.send_header("set-cookie", "sid=guest; Path=/")
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

import asyncio, contextlib, ssl, threading
from websockets.asyncio.server import serve

# argv: bind address, HTTP port, WebSocket port[, TLS HTTP port, TLS WebSocket port, cert, key]
tls = None
if len(sys.argv) > 4:
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.load_cert_chain(sys.argv[6], sys.argv[7])

async def echo(ws):
    if ws.request.path == "/headers":
        await ws.send(json.dumps({k.lower(): v for k, v in ws.request.headers.raw_items()}))
    async for message in ws:
        await ws.send(message)

async def ws_main():
    async with contextlib.AsyncExitStack() as stack:
        opts = dict(compression=None, max_size=None)
        await stack.enter_async_context(serve(echo, sys.argv[1], int(sys.argv[3]), **opts))
        if tls:
            await stack.enter_async_context(
                serve(echo, sys.argv[1], int(sys.argv[5]), ssl=tls, **opts)
            )
        await asyncio.Future()

server = ThreadingHTTPServer((sys.argv[1], int(sys.argv[2])), H)
threading.Thread(target=server.serve_forever, daemon=True).start()
if tls:
    secure = ThreadingHTTPServer((sys.argv[1], int(sys.argv[4])), H)
    secure.socket = tls.wrap_socket(secure.socket, server_side=True)
    threading.Thread(target=secure.serve_forever, daemon=True).start()
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
    home = prepare_home(tmp_path_factory.mktemp("proxy-home"))
    srv = ServerProcess(home, domain="sbx.test", ready_timeout_s=180).start()
    try:
        yield srv
    finally:
        srv.stop(timeout_s=120)
        sandboxes = home / "sandboxes"
        assert not (sandboxes.is_dir() and any(sandboxes.iterdir())), "sandboxes left behind"
    shutil.rmtree(home, ignore_errors=True)  # clean: its disks go now, not with the run


def sdk_opts(server: ServerProcess) -> dict[str, object]:
    return {
        "api_key": server.api_key,
        "api_url": server.url,
        "sandbox_url": server.url,
        "request_timeout": REQUEST_TIMEOUT_S,
    }


def websockets_tarball() -> bytes:
    """The host's `websockets` package as a .tar.gz of its Python sources."""
    root = Path(websockets.__file__).parent
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for path in sorted(root.rglob("*.py")):
            if "__pycache__" not in path.parts:
                tar.add(path, arcname=str(path.relative_to(root.parent)))
    return buf.getvalue()


def wait_port(client: httpx.Client, guest_headers: dict[str, str], path: str = "/") -> None:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        resp = client.get(path, headers=guest_headers)
        if resp.status_code != 502:
            return
        time.sleep(0.1)
    raise AssertionError(f"guest port never opened: {resp.text}")


def self_signed(directory: Path) -> tuple[Path, Path]:
    cert, key = directory / "guest-cert.pem", directory / "guest-key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-subj", "/CN=guest", "-keyout", str(key), "-out", str(cert)],
        check=True,
        capture_output=True,
    )  # fmt: skip
    return cert, key


def start_app(server: ServerProcess, sbx: Sandbox, tls: tuple[Path, Path] | None = None) -> Guest:
    """Run the HTTP and WebSocket servers of `APP` in `sbx` (also behind TLS on `TLS_*_PORT`
    with `tls`, a certificate and key); returns once they answer through the proxy (the TLS
    ones only if the sandbox has them in `httpsPorts`)."""
    rec = stored_row(server.home, sbx.sandbox_id)
    assert rec is not None and rec.address
    sbx.files.write(f"{GUEST_LIB}.tgz", websockets_tarball())
    sbx.files.write(f"{GUEST_LIB}/app.py", APP)
    sbx.commands.run(f"tar -xzf {GUEST_LIB}.tgz -C {GUEST_LIB}")
    args = f"0.0.0.0 {HTTP_PORT} {WS_PORT}"
    if tls:
        sbx.files.write(f"{GUEST_LIB}/cert.pem", tls[0].read_bytes())
        sbx.files.write(f"{GUEST_LIB}/key.pem", tls[1].read_bytes())
        args += f" {TLS_HTTP_PORT} {TLS_WS_PORT} {GUEST_LIB}/cert.pem {GUEST_LIB}/key.pem"
    sbx.commands.run(
        f"python3 {GUEST_LIB}/app.py {args}",
        background=True,
        timeout=0,
        envs={"PYTHONPATH": GUEST_LIB},
    )
    g = Guest(server, sbx, rec.address, HTTP_PORT, WS_PORT)
    with httpx.Client(base_url=server.url, timeout=10) as client:
        wait_port(client, g.headers(), "/ready")
        # The WebSocket server starts after the HTTP one; it answers a plain GET (426).
        wait_port(client, g.headers(WS_PORT))
        if tls:
            wait_port(client, g.headers(TLS_HTTP_PORT), "/ready")
            wait_port(client, g.headers(TLS_WS_PORT))
    return g


@pytest.fixture(scope="module")
def guest(proxy_server: ServerProcess) -> Iterator[Guest]:
    sbx = Sandbox.create(template="base", timeout=600, **sdk_opts(proxy_server))  # type: ignore[arg-type]
    try:
        yield start_app(proxy_server, sbx)
    finally:
        sbx.kill()
