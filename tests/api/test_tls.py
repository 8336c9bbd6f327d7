"""`--cert/--key` serve the same API over TLS."""

from __future__ import annotations

import shutil
import ssl
import subprocess
from pathlib import Path

import httpx
import pytest

from agentenv.api.devserver import ServerProcess


@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl is not installed")
def test_tls_serves_the_api(tmp_path: Path) -> None:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
         "-keyout", str(key), "-out", str(cert)],
        check=True,
        capture_output=True,
    )  # fmt: skip
    with ServerProcess(tmp_path / "home", tls=(cert, key)) as srv:
        assert srv.url.startswith("https://")
        with httpx.Client(verify=ssl.create_default_context(cafile=cert), timeout=10) as c:
            assert c.get(f"{srv.url}/health").json() == {"status": "ok"}
            resp = c.get(f"{srv.url}/v2/sandboxes", headers={"X-API-Key": srv.api_key})
            assert resp.status_code == 200 and resp.json() == []
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{srv.url}/health", timeout=5)  # untrusted certificate
