"""Two teams on one real server (two microVMs), through the unmodified SDK: team B cannot
list, read, connect to, pause, time out or kill team A's sandbox (404, as for an id that
never existed), and its key buys nothing on the proxy, where only the sandbox's own tokens
open envd and its ports. Then B's limits (429 + Retry-After) and a revoked key (401 at
once, revoked from another process). Every route family in detail: tests/api/test_tenants.py."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
from api.conftest import REQUEST_TIMEOUT_S
from e2b import AuthenticationException, NotFoundException, RateLimitException, Sandbox

from agentenv.api.devserver import ServerProcess
from agentenv.api.keys import KeyRing
from agentenv.control.sqlite_store import SqliteStore

pytestmark = pytest.mark.vm

APP_PORT = 8000


@pytest.fixture
def ring(server: ServerProcess) -> Iterator[KeyRing]:
    # A second process on the server's database, as `aenv keys`/`aenv teams` are.
    store = SqliteStore(server.home / "agentenv.db")
    try:
        yield KeyRing(store)
    finally:
        asyncio.run(store.close())


def opts(server: ServerProcess, key: str) -> dict[str, Any]:
    return {
        "api_key": key,
        "api_url": server.url,
        "sandbox_url": server.url,
        "request_timeout": REQUEST_TIMEOUT_S,
    }


def test_two_teams(server: ServerProcess, ring: KeyRing) -> None:
    team_b = asyncio.run(ring.create_team("bravo")).id
    _, key_b = asyncio.run(ring.create("bob", "bravo"))
    a_opts, b_opts = opts(server, server.api_key), opts(server, key_b)
    http = httpx.Client(base_url=server.url, timeout=REQUEST_TIMEOUT_S)
    # A's sandbox keeps its user ports private: they need its traffic token.
    made = http.post(
        "/v2/sandboxes",
        json={"templateID": "base", "timeout": 600, "network": {"allowPublicTraffic": False}},
        headers={"X-API-Key": server.api_key},
    )
    assert made.status_code == 201, made.text
    body = made.json()
    sid, envd_token, traffic_token = (
        body["sandboxID"], body["envdAccessToken"], body["trafficAccessToken"]
    )  # fmt: skip
    assert envd_token and traffic_token
    theirs: Sandbox | None = None
    try:
        a = Sandbox.connect(sid, **a_opts)
        a.commands.run(f"/.agentenv/bin/busybox httpd -p {APP_PORT} -h /etc", background=True)

        # -- B cannot see or touch A's sandbox through the API ----------------------------
        assert [s.sandbox_id for s in Sandbox.list(**b_opts).next_items()] == []
        assert sid in [s.sandbox_id for s in Sandbox.list(**a_opts).next_items()]
        for call in (
            lambda: Sandbox.get_info(sid, **b_opts),
            lambda: Sandbox.connect(sid, **b_opts),
            lambda: Sandbox.set_timeout(sid, 30, **b_opts),
            lambda: Sandbox.pause(sid, **b_opts),
        ):
            with pytest.raises(NotFoundException):
                call()
        # The SDK's answer to a 404.
        assert Sandbox.kill(sid, **b_opts) is False
        for method, path in (("GET", f"/sandboxes/{sid}"), ("GET", f"/sandboxes/{sid}/logs")):
            r = http.request(method, path, headers={"X-API-Key": key_b})
            assert r.status_code == 404 and r.json()["message"] == f"sandbox {sid!r} not found"
        # Still A's, still running, its timeout unchanged.
        info = Sandbox.get_info(sid, **a_opts)
        assert info.state.value == "running"
        assert (info.end_at - info.started_at).total_seconds() > 500

        # -- the proxy: B's key opens nothing, A's tokens do ------------------------------
        envd = {"e2b-sandbox-id": sid, "content-type": "application/json"}
        listed = http.post(
            "/process.Process/List", content=b"{}", headers={**envd, "X-API-Key": key_b}
        )
        assert listed.status_code == 401, listed.text  # envd: no access token
        listed = http.post(
            "/process.Process/List", content=b"{}", headers={**envd, "x-access-token": envd_token}
        )
        assert listed.status_code == 200, listed.text
        app = {"e2b-sandbox-id": sid, "e2b-sandbox-port": str(APP_PORT)}
        for headers in (
            {**app, "X-API-Key": key_b},
            {**app, "X-API-Key": server.api_key},  # not even A's key: the token is needed
            {**app, "e2b-traffic-access-token": "guessed"},
        ):
            refused = http.get("/hostname", headers=headers)
            assert refused.status_code == 403, refused.text
        served = None
        for _ in range(50):  # httpd starts in the background: at most 10 s
            time.sleep(0.2)
            served = http.get(
                "/hostname", headers={**app, "e2b-traffic-access-token": traffic_token}
            )
            if served.status_code == 200:
                break
        assert served is not None and served.status_code == 200 and served.text.strip()

        # -- B's limits: a create a minute, then one sandbox at a time -------------------
        asyncio.run(ring.set_limits("bravo", max_sandboxes=2, creates_per_minute=1))
        with ThreadPoolExecutor(1) as pool:
            booting = pool.submit(Sandbox.create, "base", timeout=120, **b_opts)
            # While B's first create boots (its row holds the minute's one token) ...
            for _ in range(300):
                if asyncio.run(ring.store.select(team_id=team_b)):
                    break
                time.sleep(0.1)
            over = http.post(
                "/v2/sandboxes", json={"templateID": "base"}, headers={"X-API-Key": key_b}
            )
            assert over.status_code == 429 and "per minute" in over.json()["message"], over.text
            assert 30 <= int(over.headers["retry-after"]) <= 60
            theirs = booting.result(timeout=REQUEST_TIMEOUT_S)
        with pytest.raises(NotFoundException):
            Sandbox.get_info(theirs.sandbox_id, **a_opts)
        asyncio.run(ring.set_limits("bravo", max_sandboxes=1, creates_per_minute=0))
        # retries=0: the SDK would wait out Retry-After three times (~90 s) before raising.
        with pytest.raises(RateLimitException, match="concurrent sandboxes"):
            Sandbox.create("base", retries=0, **b_opts)
        over = http.post("/v2/sandboxes", json={"templateID": "base"}, headers={"X-API-Key": key_b})
        assert over.status_code == 429 and 1 <= int(over.headers["retry-after"]) <= 30
        assert Sandbox.kill(theirs.sandbox_id, **b_opts) is True
        theirs = None

        # -- revocation: the next call is a 401 -------------------------------------------
        bob = next(k for k in asyncio.run(ring.list()) if k.name == "bob")
        asyncio.run(ring.revoke(bob.id))
        with pytest.raises(AuthenticationException):
            Sandbox.list(**b_opts).next_items()
        r = http.get("/v2/sandboxes", headers={"X-API-Key": key_b})
        assert r.status_code == 401 and r.json() == {"code": 401, "message": "invalid API key"}
    finally:
        if theirs is not None:
            Sandbox.kill(theirs.sandbox_id, **b_opts)
        http.delete(f"/sandboxes/{sid}", headers={"X-API-Key": server.api_key})
        http.close()
