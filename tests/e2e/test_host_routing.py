"""The production form: the server owns a domain (`--domain sbx.test`), wildcard DNS
`*.sbx.test` points at it and a wildcard certificate covers it, so every sandbox port is
`https://{port}-{id}.sbx.test`. The SDK then needs only `E2B_API_URL`: the create response's
`domain` makes it build host URLs (also for `download_url()`/`upload_url()`), and no routing
header or signature search is involved.

No real DNS: this test process maps `*.sbx.test` to the server on loopback (its own
`getaddrinfo`), and TLS is verified against the test's certificate for that wildcard.
"""

from __future__ import annotations

import shutil
import socket
import ssl
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from api.conftest import REQUEST_TIMEOUT_S, stop_and_check
from e2b import ConnectionConfig, Sandbox
from packaging.version import Version

from agentenv.api.devserver import ServerProcess
from agentenv.template.datadir import prepare_home

pytestmark = [
    pytest.mark.vm,
    pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl is not installed"),
]

DOMAIN = "sbx.test"


def wildcard_cert(directory: Path) -> tuple[Path, Path]:
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-subj", f"/CN=*.{DOMAIN}",
         "-addext", f"subjectAltName=DNS:*.{DOMAIN},DNS:{DOMAIN},IP:127.0.0.1",
         "-keyout", str(key), "-out", str(cert)],
        check=True,
        capture_output=True,
    )  # fmt: skip
    return cert, key


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    base = tmp_path_factory.mktemp("host-routing")
    home = prepare_home(base / "home")
    srv = ServerProcess(home, domain=DOMAIN, tls=wildcard_cert(base), ready_timeout_s=180)
    srv.start()
    try:
        yield srv
    finally:
        stop_and_check(srv)


def wildcard_dns(monkeypatch: pytest.MonkeyPatch, port: int) -> None:
    """`*.sbx.test` (any port) resolves to the server on 127.0.0.1 in this process, until
    the test ends."""
    real = socket.getaddrinfo

    def lookup(host: Any, service: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(host, str) and (host == DOMAIN or host.endswith("." + DOMAIN)):
            return real("127.0.0.1", port, *args, **kwargs)
        return real(host, service, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", lookup)


def test_sdk_host_urls_over_wildcard_tls(
    tls_server: ServerProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("E2B_SANDBOX_URL", raising=False)
    monkeypatch.delenv("E2B_DOMAIN", raising=False)
    assert tls_server.tls is not None
    trust = ssl.create_default_context(cafile=tls_server.tls[0])
    api = httpx.Client(
        base_url=tls_server.url,
        headers={"X-API-Key": tls_server.api_key},
        verify=trust,
        timeout=REQUEST_TIMEOUT_S,
    )
    created = api.post("/v2/sandboxes", json={"templateID": "base", "timeout": 300})
    assert created.status_code == 201, created.text
    body = created.json()
    sid = body["sandboxID"]
    try:
        assert body["domain"] == DOMAIN
        # What the SDK makes of that response with only the API URL configured.
        sbx = Sandbox(
            sandbox_id=sid,
            sandbox_domain=body["domain"],
            envd_version=Version(body["envdVersion"]),
            envd_access_token=body["envdAccessToken"],
            traffic_access_token=body.get("trafficAccessToken"),
            connection_config=ConnectionConfig(api_key=tls_server.api_key, api_url=tls_server.url),
        )
        envd = f"https://49983-{sid}.{DOMAIN}"
        assert sbx.envd_api_url == envd
        assert sbx.get_host(8080) == f"8080-{sid}.{DOMAIN}"
        path = "/home/user/by-host.txt"
        upload = sbx.upload_url(path, use_signature_expiration=120)
        assert upload.startswith(f"{envd}/files?")
        wildcard_dns(monkeypatch, tls_server.port)
        with httpx.Client(verify=trust, timeout=60) as http:
            resp = http.post(upload, files={"file": ("x", b"over the sandbox's own host")})
            assert resp.status_code == 200, resp.text
            got = http.get(sbx.download_url(path))
            assert got.status_code == 200 and got.content == b"over the sandbox's own host"
            # /health on a sandbox host is envd's (the server's own has a JSON body).
            health = http.get(f"{envd}/health")
            assert health.status_code == 204, health.text
            # A Connect call the SDK would make, routed by host alone (no e2b-sandbox-id).
            listed = http.post(
                f"{envd}/process.Process/List",
                content=b"{}",
                headers={
                    "content-type": "application/json",
                    "x-access-token": sbx._envd_access_token or "",
                },
            )
            assert listed.status_code == 200, listed.text
            no_token = http.post(
                f"{envd}/process.Process/List",
                content=b"{}",
                headers={"content-type": "application/json"},
            )
            assert no_token.status_code == 401, no_token.text
            # The API under the same wildcard is the control plane.
            api_host = http.get(
                f"https://api.{DOMAIN}/sandboxes/{sid}", headers={"X-API-Key": tls_server.api_key}
            )
            assert api_host.status_code == 200 and api_host.json()["sandboxID"] == sid
            # A closed port on a live sandbox, and a sandbox that does not exist.
            closed = http.get(f"https://1234-{sid}.{DOMAIN}/")
            assert closed.status_code == 502 and "not open" in closed.json()["message"]
            unknown = http.get(f"https://49983-inosuchsandbox.{DOMAIN}/health")
            assert unknown.status_code == 502 and "was not found" in unknown.text
    finally:
        assert api.delete(f"/sandboxes/{sid}").status_code == 204
        api.close()
