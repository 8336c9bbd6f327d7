"""Proxy traffic to a paused sandbox: resumed when its create asked (`autoResume`, as E2B),
a clear error otherwise; `AGENTENV_AUTO_RESUME=1` also resumes those that did not say."""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import Iterator

import httpx
import pytest
from e2b import Sandbox
from websockets.asyncio.client import connect as ws_connect
from websockets.exceptions import InvalidStatus

from agentenv.api.devserver import ServerProcess
from agentenv.template.datadir import prepare_home

from .conftest import Guest, sdk_opts, start_app, wait_port

pytestmark = pytest.mark.vm

PORT = 8080
# A resume restores a memory snapshot under emulation: seconds, bounded well above that.
RESUME_TIMEOUT_S = 180.0
# What E2B's SDK sends for `autoResume: {"enabled": true}` (it needs on_timeout "pause").
AUTO_RESUME = {"on_timeout": "pause", "auto_resume": True}


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


def test_request_to_paused_sandbox_resumes_it_when_it_asked(proxy_server: ServerProcess) -> None:
    sbx = Sandbox.create(
        template="base",
        timeout=300,
        lifecycle=AUTO_RESUME,  # type: ignore[arg-type]
        **sdk_opts(proxy_server),  # type: ignore[arg-type]
    )
    sid = sbx.sandbox_id
    hdrs = {"e2b-sandbox-id": sid, "e2b-sandbox-port": str(PORT)}
    try:
        with _api(proxy_server) as api:
            assert api.get(f"/sandboxes/{sid}").json()["lifecycle"]["autoResume"] is True
            secret = _serve_secret(sbx)
            wait_port(api, hdrs, "/secret.txt")
            _pause(api, sid)
            started = time.monotonic()
            resp = api.get("/secret.txt", headers=hdrs)
            print(f"request that resumed the sandbox took {time.monotonic() - started:.2f} s")
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


def _ws_url(server: ServerProcess) -> str:
    return server.url.replace("http://", "ws://") + "/"


async def _echo(g: Guest, message: str) -> str:
    # The handshake waits for the resume: give it the resume's bound, not the 10 s default.
    async with ws_connect(
        _ws_url(g.server), additional_headers=g.headers(g.ws_port), open_timeout=RESUME_TIMEOUT_S
    ) as ws:
        await ws.send(message)
        reply = await ws.recv()
    return reply if isinstance(reply, str) else reply.decode()


def test_websocket_to_paused_sandbox_resumes_it(proxy_server: ServerProcess) -> None:
    sbx = Sandbox.create(
        template="base",
        timeout=300,
        lifecycle=AUTO_RESUME,  # type: ignore[arg-type]
        **sdk_opts(proxy_server),  # type: ignore[arg-type]
    )
    sid = sbx.sandbox_id
    try:
        g = start_app(proxy_server, sbx)
        # Echoing once first proves the guest's WebSocket server is up before the pause.
        assert asyncio.run(_echo(g, "before")) == "before"
        with _api(proxy_server) as api:
            _pause(api, sid)
            word = secrets.token_hex(8)
            started = time.monotonic()
            assert asyncio.run(_echo(g, word)) == word
            print(f"WebSocket that resumed the sandbox took {time.monotonic() - started:.2f} s")
            assert api.get(f"/sandboxes/{sid}").json()["state"] == "running"
    finally:
        sbx.kill()


def test_by_default_a_paused_sandbox_stays_paused(proxy_server: ServerProcess) -> None:
    # No lifecycle: E2B resumes on traffic only when autoResume was enabled, so neither the
    # SDK's own liveness check (envd /health through the proxy) nor a user port wakes it.
    sbx = Sandbox.create(template="base", timeout=300, **sdk_opts(proxy_server))  # type: ignore[arg-type]
    sid = sbx.sandbox_id
    try:
        with _api(proxy_server) as api:
            assert api.get(f"/sandboxes/{sid}").json()["lifecycle"]["autoResume"] is False
            assert sbx.is_running()
            _pause(api, sid)
            assert not sbx.is_running()
            resp = api.get("/", headers={"e2b-sandbox-id": sid, "e2b-sandbox-port": str(PORT)})
            assert resp.status_code == 502 and "paused" in resp.json()["message"]
            assert api.get(f"/sandboxes/{sid}").json()["state"] == "paused"
            # An explicit connect still resumes it.
            assert Sandbox.connect(sid, **sdk_opts(proxy_server)).is_running()  # type: ignore[arg-type]
            assert api.get(f"/sandboxes/{sid}").json()["state"] == "running"
    finally:
        sbx.kill()


def test_by_default_a_websocket_to_a_paused_sandbox_is_refused(
    proxy_server: ServerProcess,
) -> None:
    sbx = Sandbox.create(template="base", timeout=300, **sdk_opts(proxy_server))  # type: ignore[arg-type]
    sid = sbx.sandbox_id
    try:
        g = start_app(proxy_server, sbx)
        assert asyncio.run(_echo(g, "before")) == "before"
        with _api(proxy_server) as api:
            _pause(api, sid)
            with pytest.raises(InvalidStatus) as info:
                asyncio.run(_echo(g, "after"))
            resp = info.value.response
            assert resp.status_code == 502
            assert resp.headers["content-type"].startswith("application/json")
            body = json.loads(resp.body)
            assert body["code"] == 502 and body["sandboxId"] == sid
            assert "was not found" in body["message"] and "paused" in body["message"]
            assert api.get(f"/sandboxes/{sid}").json()["state"] == "paused"
    finally:
        sbx.kill()


@pytest.fixture(scope="module")
def switch_on_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    home = prepare_home(tmp_path_factory.mktemp("resume-all-home"))
    srv = ServerProcess(home, ready_timeout_s=180, env={"AGENTENV_AUTO_RESUME": "1"}).start()
    try:
        yield srv
    finally:
        srv.stop(timeout_s=120)
        sandboxes = home / "sandboxes"
        assert not (sandboxes.is_dir() and any(sandboxes.iterdir())), "sandboxes left behind"


def test_switch_on_resumes_sandboxes_that_did_not_say(switch_on_server: ServerProcess) -> None:
    opts = sdk_opts(switch_on_server)
    with _api(switch_on_server) as api:
        refused = Sandbox.create(
            template="base",
            timeout=300,
            lifecycle={"on_timeout": "pause", "auto_resume": False},
            **opts,  # type: ignore[arg-type]
        )
        try:
            lifecycle = api.get(f"/sandboxes/{refused.sandbox_id}").json()["lifecycle"]
            assert lifecycle["autoResume"] is False
        finally:
            refused.kill()
        sbx = Sandbox.create(template="base", timeout=300, **opts)  # type: ignore[arg-type]
        sid = sbx.sandbox_id
        try:
            assert api.get(f"/sandboxes/{sid}").json()["lifecycle"]["autoResume"] is True
            _pause(api, sid)
            # The SDK's liveness check is traffic like any other: it wakes the sandbox.
            assert sbx.is_running()
            assert api.get(f"/sandboxes/{sid}").json()["state"] == "running"
        finally:
            sbx.kill()
