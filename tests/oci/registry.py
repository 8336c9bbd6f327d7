"""A real registry (Debian's docker-registry) on 127.0.0.1, and a token issuer for it.

`Registry.start(storage, auth=...)` writes a config and runs ``docker-registry serve`` by
PID with a bounded wait for ``/v2/``; `stop()` ends that PID. Several registries may serve
one storage dir: tests push through one without auth and pull through authenticated ones.

docker-registry checks bearer tokens but does not issue them (the distribution token spec
puts the issuer in a separate service), so `TokenIssuer` is a small one the test runs: it
checks basic credentials and signs an RS256 JWT with the registry's trusted key (certificate
in the ``x5c`` header) using the openssl command line.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import socket
import subprocess
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx

REGISTRY_BIN = "/usr/bin/docker-registry"
READY_TIMEOUT_S = 15.0
STOP_TIMEOUT_S = 10.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Registry:
    def __init__(self, proc: subprocess.Popen[bytes], port: int, log: Path) -> None:
        self.proc = proc
        self.port = port
        self.log = log

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.host}"

    @classmethod
    def start_basic(cls, workdir: Path, storage: Path, user: str, password: str) -> Registry:
        """A registry over `storage` that wants htpasswd basic auth for `user`."""
        workdir.mkdir(parents=True, exist_ok=True)
        htpasswd(workdir / "htpasswd", user, password)
        auth = {"htpasswd": {"realm": "test", "path": str(workdir / "htpasswd")}}
        return cls.start(workdir, storage, auth)

    @classmethod
    def start(cls, workdir: Path, storage: Path, auth: dict[str, object] | None = None) -> Registry:
        workdir.mkdir(parents=True, exist_ok=True)
        port = free_port()
        config: dict[str, object] = {
            "version": 0.1,
            "log": {"level": "info", "formatter": "text"},
            "storage": {"filesystem": {"rootdirectory": str(storage)}, "delete": {"enabled": True}},
            "http": {"addr": f"127.0.0.1:{port}"},
        }
        if auth:
            config["auth"] = auth
        cfg = workdir / "config.yml"
        # JSON is YAML: no yaml library needed.
        cfg.write_text(json.dumps(config))
        log = workdir / "registry.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(
                [REGISTRY_BIN, "serve", str(cfg)], stdout=out, stderr=subprocess.STDOUT
            )
        reg = cls(proc, port, log)
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"docker-registry exited: {log.read_text()[-2000:]}")
            try:
                r = httpx.get(f"{reg.url}/v2/", timeout=1.0)
                if r.status_code in (200, 401):
                    return reg
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                reg.stop()
                raise RuntimeError(f"docker-registry not ready in {READY_TIMEOUT_S}s")
            time.sleep(0.05)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(STOP_TIMEOUT_S)

    def requests(self, needle: str) -> int:
        """Access log lines containing `needle` (e.g. ``GET /v2/app/blobs/sha256:…``)."""
        return sum(
            1 for line in self.log.read_text(errors="replace").splitlines() if needle in line
        )


def _b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


class TokenIssuer:
    """The token service of a registry with ``auth: token``; see the module docstring."""

    SERVICE = "test-registry"
    ISSUER = "agentenv-test-issuer"

    def __init__(self, workdir: Path, users: dict[str, str]) -> None:
        self.workdir = workdir
        self.users = users
        self.key = workdir / "issuer.key"
        self.cert = workdir / "issuer.crt"
        workdir.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout",
             str(self.key), "-out", str(self.cert), "-days", "2", "-subj", "/CN=issuer"],
            check=True, capture_output=True, timeout=60,
        )  # fmt: skip
        der = subprocess.run(
            ["openssl", "x509", "-in", str(self.cert), "-outform", "DER"],
            check=True, capture_output=True, timeout=60,
        ).stdout  # fmt: skip
        self.x5c = base64.b64encode(der).decode()
        self.requests: list[dict[str, str]] = []
        issuer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                query = dict(urllib.parse.parse_qsl(urllib.parse.urlsplit(self.path).query))
                issuer.requests.append(query)
                user = issuer.check(self.headers.get("Authorization"))
                if user is None:
                    self.send_response(401)
                    self.end_headers()
                    return
                body = json.dumps({"token": issuer.sign(user, query.get("scope", "")),
                                   "expires_in": 300}).encode()  # fmt: skip
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = int(self.server.server_address[1])
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def realm(self) -> str:
        return f"http://127.0.0.1:{self.port}/token"

    def registry_auth(self) -> dict[str, object]:
        return {
            "token": {
                "realm": self.realm,
                "service": self.SERVICE,
                "issuer": self.ISSUER,
                "rootcertbundle": str(self.cert),
            }
        }

    def check(self, header: str | None) -> str | None:
        if not header or not header.startswith("Basic "):
            return None
        user, _, password = base64.b64decode(header[6:]).decode().partition(":")
        return user if self.users.get(user) == password else None

    def sign(self, user: str, scope: str) -> str:
        access = []
        for item in scope.split(" "):
            parts = item.split(":")
            if len(parts) == 3:
                access.append({"type": parts[0], "name": parts[1], "actions": parts[2].split(",")})
        now = int(time.time())
        header = {"typ": "JWT", "alg": "RS256", "x5c": [self.x5c]}
        claims = {
            "iss": self.ISSUER,
            "sub": user,
            "aud": self.SERVICE,
            "exp": now + 300,
            "nbf": now - 10,
            "iat": now,
            "jti": os.urandom(8).hex(),
            "access": access,
        }
        signing_input = (
            f"{_b64url(json.dumps(header).encode())}.{_b64url(json.dumps(claims).encode())}"
        )
        sig = subprocess.run(
            ["openssl", "dgst", "-sha256", "-sign", str(self.key)],
            input=signing_input.encode(), check=True, capture_output=True, timeout=30,
        ).stdout  # fmt: skip
        return f"{signing_input}.{_b64url(sig)}"

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)


def htpasswd(path: Path, user: str, password: str) -> None:
    """A bcrypt htpasswd file (the only hash docker-registry accepts), from apache2-utils."""
    subprocess.run(
        ["htpasswd", "-Bbc", str(path), user, password], check=True, capture_output=True, timeout=30
    )
