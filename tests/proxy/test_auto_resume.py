"""Proxy traffic to a paused sandbox: resumed by default, a clear error when opted out."""

from __future__ import annotations

import secrets

import httpx
import pytest
from e2b import Sandbox

from agentenv.api.devserver import ServerProcess

from .conftest import sdk_opts, wait_port

pytestmark = pytest.mark.vm

PORT = 8080
# A resume restores a memory snapshot under emulation: seconds, bounded well above that.
RESUME_TIMEOUT_S = 180.0


def _serve_secret(sbx: Sandbox) -> str:
    secret = secrets.token_hex(8)
    sbx.files.write("/tmp/www/secret.txt", secret)
    sbx.commands.run(
        f"python3 -m http.server {PORT} --directory /tmp/www", background=True, timeout=0
    )
    return secret


def _pause(api: httpx.Client, sid: str) -> None:
    resp = api.post(f"/sandboxes/{sid}/pause")
    assert resp.status_code == 204, resp.text
    assert api.get(f"/sandboxes/{sid}").json()["state"] == "paused"


def _api(server: ServerProcess) -> httpx.Client:
    return httpx.Client(
        base_url=server.url, headers={"X-API-Key": server.api_key}, timeout=RESUME_TIMEOUT_S
    )


def test_request_to_paused_sandbox_resumes_it_by_default(proxy_server: ServerProcess) -> None:
    # No lifecycle at all: the server's default (AGENTENV_AUTO_RESUME, on) applies.
    sbx = Sandbox.create(template="base", timeout=300, **sdk_opts(proxy_server))  # type: ignore[arg-type]
    sid = sbx.sandbox_id
    hdrs = {"e2b-sandbox-id": sid, "e2b-sandbox-port": str(PORT)}
    try:
        with _api(proxy_server) as api:
            assert api.get(f"/sandboxes/{sid}").json()["lifecycle"]["autoResume"] is True
            secret = _serve_secret(sbx)
            wait_port(api, hdrs, "/secret.txt")
            _pause(api, sid)
            resp = api.get("/secret.txt", headers=hdrs)
            assert resp.status_code == 200, resp.text
            assert resp.text == secret
            assert api.get(f"/sandboxes/{sid}").json()["state"] == "running"
    finally:
        sbx.kill()


def test_opted_out_sandbox_stays_paused_with_a_clear_error(proxy_server: ServerProcess) -> None:
    sbx = Sandbox.create(
        template="base",
        timeout=300,
        lifecycle={"on_timeout": "pause", "auto_resume": False},
        **sdk_opts(proxy_server),  # type: ignore[arg-type]
    )
    sid = sbx.sandbox_id
    hdrs = {"e2b-sandbox-id": sid, "e2b-sandbox-port": str(PORT)}
    try:
        with _api(proxy_server) as api:
            assert api.get(f"/sandboxes/{sid}").json()["lifecycle"]["autoResume"] is False
            _serve_secret(sbx)
            wait_port(api, hdrs, "/secret.txt")
            _pause(api, sid)
            resp = api.get("/secret.txt", headers=hdrs, timeout=30)
            assert resp.status_code == 502, resp.text
            assert resp.headers["content-type"].startswith("application/json")
            body = resp.json()
            assert body["sandboxId"] == sid
            assert "was not found" in body["message"] and "paused" in body["message"]
            assert api.get(f"/sandboxes/{sid}").json()["state"] == "paused"
    finally:
        sbx.kill()
