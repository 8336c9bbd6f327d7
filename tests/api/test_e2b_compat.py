"""What upstream E2B's API server does (e2b-dev/infra `packages/api`, `spec/openapi.yml`), through
the official Python SDK where it has a call: the API key format, refusals of what this server
does not implement (naming the field), the list's order, cursor and `startedAfter`, the metrics
range, template aliases, and a paused sandbox that only wakes when its create asked.

Tests marked `vm` boot one microVM; the others create none (listing rows are written straight
into the server's store as paused sandboxes, which nothing but the list looks at).
"""

from __future__ import annotations

import re
import secrets
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import httpx
import pytest
from e2b import Sandbox, SandboxQuery, SandboxState, Template
from e2b.exceptions import (
    SandboxException,
    SandboxNotFoundException,
    ServiceBusyException,
    TimeoutException,
)

from agentenv.api.devserver import ServerProcess
from agentenv.api.keys import KeyRing, hash_key
from agentenv.api.views import iso as views_iso
from agentenv.control.store import ApiKey, SandboxRecord, Store
from agentenv.control.store import SandboxState as RowState

from .conftest import REQUEST_TIMEOUT_S, db_path, on_store

# The JS SDK (2.27 to 2.45, packages/js-sdk/src/api/index.ts) refuses any other key before
# sending anything; E2B issues `e2b_` + hex of 20 random bytes (packages/shared/pkg/keys).
JS_SDK_KEY_PATTERN = re.compile(r"^e2b_[0-9a-f]+$")
E2B_KEY = re.compile(r"e2b_[0-9a-f]{40}")
UNKNOWN_ID = "i" + "0" * 19


def sdk_opts(server: ServerProcess, key: str | None = None) -> dict[str, object]:
    return {
        "api_key": key or server.api_key,
        "api_url": server.url,
        "sandbox_url": server.url,
        "request_timeout": REQUEST_TIMEOUT_S,
    }


@pytest.fixture
def api(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(
        base_url=server.url, headers={"X-API-Key": server.api_key}, timeout=REQUEST_TIMEOUT_S
    ) as client:
        yield client


def _error(resp: httpx.Response, status: int) -> str:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert body["code"] == status
    message: str = body["message"]
    return message


# -- 1. API keys ------------------------------------------------------------------------------


def test_keys_are_issued_in_e2b_format_and_older_keys_still_work(server: ServerProcess) -> None:
    assert E2B_KEY.fullmatch(server.api_key) and JS_SDK_KEY_PATTERN.match(server.api_key)
    # A key issued before the change (another prefix) is found by its hash as before.
    legacy = "aenv_" + secrets.token_hex(20)

    async def issue(store: Store) -> tuple[ApiKey, str]:
        made = await KeyRing(store).create("js")
        await store.add_key(
            "klegacy" + secrets.token_hex(3), "legacy", legacy[:9], hash_key(legacy)
        )
        return made

    key, secret = on_store(db_path(server), issue)
    assert E2B_KEY.fullmatch(secret) and key.prefix == secret[:8]
    for k in (server.api_key, secret, legacy):
        assert Sandbox.list(**sdk_opts(server, k)).next_items() == []  # type: ignore[arg-type]
    on_store(db_path(server), lambda store: KeyRing(store).revoke(key.id))
    with httpx.Client(base_url=server.url, timeout=10) as client:
        assert client.get("/v2/sandboxes", headers={"X-API-Key": secret}).status_code == 401


# -- 3. refusals that name the field ----------------------------------------------------------


def test_filesystem_only_bodies_reach_the_lookup_and_auto_resume_is_refused_with_them(
    server: ServerProcess, api: httpx.Client
) -> None:
    """Filesystem-only pause, snapshot and resume are implemented (tests/e2e/
    test_filesystem_pause.py): their bodies pass the check and reach the lookup. As E2B,
    a create cannot ask traffic to resume a filesystem-only auto-pause (the SDK refuses it
    before sending; the API answers 400 naming both fields)."""
    opts = sdk_opts(server)
    body = {
        "templateID": "base",
        "autoPause": True,
        "autoPauseMemory": False,
        "autoResume": {"enabled": True},
    }
    msg = _error(api.post("/v2/sandboxes", json=body), 400)
    assert "autoResume" in msg and "autoPauseMemory: false" in msg
    assert api.get("/v2/sandboxes").json() == []
    with pytest.raises(SandboxNotFoundException):
        Sandbox.pause(UNKNOWN_ID, mode="filesystem", **opts)  # type: ignore[arg-type]
    with pytest.raises(SandboxNotFoundException):
        Sandbox.beta_pause(UNKNOWN_ID, keep_memory=False, **opts)  # type: ignore[arg-type]
    with pytest.raises(SandboxNotFoundException):
        Sandbox.connect(UNKNOWN_ID, on_resume="reboot", **opts)  # type: ignore[arg-type]
    _error(api.post(f"/sandboxes/{UNKNOWN_ID}/snapshots", json={"memory": False}), 404)
    assert "colour" in _error(api.post(f"/sandboxes/{UNKNOWN_ID}/pause", json={"colour": 1}), 400)
    for pause_body in ({}, {"memory": True}, {"memory": False}, {"requireHealthyGuest": True}):
        _error(api.post(f"/sandboxes/{UNKNOWN_ID}/pause", json=pause_body), 404)
    for resume_body in ({"autoPause": True}, {"memory": False}):
        _error(api.post(f"/sandboxes/{UNKNOWN_ID}/resume", json=resume_body), 404)


def test_unenforced_network_policy_is_refused_naming_the_field(
    server: ServerProcess, api: httpx.Client
) -> None:
    """What the egress policy cannot enforce is a 400 that names it, not a sandbox that
    silently has the internet: entries that are neither IPv4 CIDRs nor domain names, resolvers
    that are not IPv4 addresses, proxies, rules and workload identity."""
    opts = sdk_opts(server)
    with pytest.raises(SandboxException, match=re.escape("network.allowOut")):
        Sandbox.create(template="base", network={"allow_out": ["::1"]}, **opts)  # type: ignore[arg-type]
    for field, value in (
        ("allowOut", ["not a name"]),
        ("denyOut", ["2001:db8::/32"]),
        ("dnsServers", ["resolver.example"]),
        ("egressProxy", {"address": "proxy.example:1080"}),
        ("rules", {"api.example.com": []}),
    ):
        body = {"templateID": "base", "network": {field: value}}
        assert f"network.{field}" in _error(api.post("/v2/sandboxes", json=body), 400)
    body = {"templateID": "base", "iam": {"tokens": {}}}
    assert "iam" in _error(api.post("/v2/sandboxes", json=body), 400)
    assert api.get("/v2/sandboxes").json() == []


def test_ingress_options_are_checked_as_e2b_checks_them(
    server: ServerProcess, api: httpx.Client
) -> None:
    """`maskRequestHost` and `httpsPorts` are enforced by the proxy (tests/proxy); what it
    could not apply is a 400 naming the field, before any sandbox exists."""
    for network in (
        {"maskRequestHost": "bad host/${PORT}"},
        {"maskRequestHost": "ünicode.example.com"},
        {"httpsPorts": [0]},
        {"httpsPorts": [49983]},
    ):
        body = {"templateID": "base", "network": network}
        message = _error(api.post("/v2/sandboxes", json=body), 400)
        assert f"network.{next(iter(network))}" in message, message
    # What upstream's check lets through passes ours (an empty mask is no mask there too;
    # so is an empty port), and so does `${PORT}` in the host, which its IDNA check refuses:
    # the create goes on to the template lookup (a 404 here, so no sandbox is made).
    for mask in (
        "",
        "localhost:${PORT}",
        "${PORT}-app.example.com",
        "example.com:",
        "Host.Example",
    ):
        body = {"templateID": "no-such-template", "network": {"maskRequestHost": mask}}
        _error(api.post("/v2/sandboxes", json=body), 404)
    assert api.get("/v2/sandboxes").json() == []


# -- 4. list order, cursor, startedAfter ------------------------------------------------------


def _paused_row(sandbox_id: str, started_at: float, suite: str) -> SandboxRecord:
    return SandboxRecord(
        id=sandbox_id,
        template="base",
        alias="base",
        state=RowState.PAUSED,
        started_at=started_at,
        end_at=time.time(),
        cpu=1,
        memory_mb=512,
        disk_mb=1024,
        envd_version="0.6.4",
        metadata={"suite": suite},
    )


def _ids(paginator: object) -> list[str]:
    seen: list[str] = []
    while paginator.has_next:  # type: ignore[attr-defined]
        page = paginator.next_items()  # type: ignore[attr-defined]
        assert len(page) <= 2
        seen += [s.sandbox_id for s in page]
    return seen


def test_list_is_newest_first_with_e2b_cursors_and_an_inclusive_started_after(
    server: ServerProcess, api: httpx.Client
) -> None:
    suite = secrets.token_hex(4)
    db = db_path(server)
    # Not inserted in start order. `b` and `c` start in the same microsecond (ids break the
    # tie); `d` starts a fraction of a microsecond before the one the API shows it at, as a
    # float timestamp does.
    base = 1_700_000_000.0
    starts = {"d": base + 30.1234567, "b": base + 20.5, "c": base + 20.5, "a": base + 10.0}
    starts["e"] = base + 40.0
    ids = {k: "i" + suite + k * 11 for k in starts}
    assert views_iso(starts["d"]).endswith(".123457Z")
    newest_first = [ids[k] for k in "edbca"]

    async def insert(store: Store) -> None:
        for k, ts in starts.items():
            await store.insert(_paused_row(ids[k], ts, suite))

    on_store(db, insert)
    opts = sdk_opts(server)
    query = SandboxQuery(metadata={"suite": suite}, state=[SandboxState.PAUSED])
    try:
        # Default: newest first, two per page, every row once.
        assert _ids(Sandbox.list(query=query, limit=2, **opts)) == newest_first  # type: ignore[arg-type]
        # asc is the exact reverse (ties included), as E2B's keyset order.
        asc = Sandbox.list(query=query, limit=2, order="asc", **opts)  # type: ignore[arg-type]
        assert _ids(asc) == list(reversed(newest_first))

        # startedAfter is "at or after": the startedAt the SDK read back selects that row.
        listed = Sandbox.list(query=query, **opts).next_items()  # type: ignore[arg-type]
        d = next(s for s in listed if s.sandbox_id == ids["d"])
        at_d = SandboxQuery(
            metadata={"suite": suite}, state=[SandboxState.PAUSED], started_after=d.started_at
        )
        assert _ids(Sandbox.list(query=at_d, limit=2, **opts)) == newest_first[:2]  # type: ignore[arg-type]
        later = SandboxQuery(
            metadata={"suite": suite},
            state=[SandboxState.PAUSED],
            started_after=d.started_at + timedelta(microseconds=1),
        )
        assert _ids(Sandbox.list(query=later, limit=2, **opts)) == newest_first[:1]  # type: ignore[arg-type]

        # A cursor carries its order; replayed under the other order it is refused.
        params = {"metadata": f"suite={suite}", "limit": "2"}
        first = api.get("/v2/sandboxes", params=params)
        token = first.headers["x-next-token"]
        assert first.headers["x-total-running"] == "0"
        assert "order=desc" in _error(
            api.get("/v2/sandboxes", params={**params, "nextToken": token, "order": "asc"}), 400
        )
        _error(api.get("/v2/sandboxes", params={**params, "nextToken": "bm9wZQ"}), 400)
        _error(api.get("/v2/sandboxes", params={**params, "order": "sideways"}), 400)
        paused_only = api.get("/v2/sandboxes", params={**params, "state": "paused"})
        assert "x-total-running" not in paused_only.headers
        started = datetime.fromtimestamp(base + 20.5, UTC).isoformat()
        tied = api.get("/v2/sandboxes", params={**params, "limit": "10", "startedAfter": started})
        assert [s["sandboxID"] for s in tied.json()] == newest_first[:4]
    finally:

        async def remove(store: Store) -> None:
            for sandbox_id in ids.values():
                await store.transition(sandbox_id, RowState.PAUSED, RowState.GONE)

        on_store(db, remove)


# -- 4. metrics range, template aliases --------------------------------------------------------


def test_metrics_range_is_validated(api: httpx.Client) -> None:
    assert "Invalid time range" in _error(
        api.get(f"/sandboxes/{UNKNOWN_ID}/metrics", params={"start": 20, "end": 10}), 400
    )
    _error(api.get(f"/sandboxes/{UNKNOWN_ID}/metrics", params={"start": -1}), 400)
    _error(api.get(f"/sandboxes/{UNKNOWN_ID}/metrics", params={"start": 10, "end": 20}), 404)


def test_template_alias_lookup(server: ServerProcess, api: httpx.Client) -> None:
    opts = sdk_opts(server)
    assert Template.exists("base", **opts) is True  # type: ignore[arg-type]
    assert Template.exists("no-such-template", **opts) is False  # type: ignore[arg-type]
    assert api.get("/templates/aliases/base").json() == {"templateID": "base", "public": False}
    assert "no-such-template" in _error(api.get("/templates/aliases/no-such-template"), 404)
    _error(api.get("/templates/aliases/x", headers={"X-API-Key": "e2b_" + "0" * 40}), 401)


# -- connect to a sandbox without tokens ----------------------------------------------------


def test_connect_to_a_sandbox_without_tokens_leaves_them_out(
    server: ServerProcess, api: httpx.Client
) -> None:
    """A sandbox without tokens (a v1 create with `secure: false`, public traffic): connect
    answers 200 with the tokens left out, as upstream's API (`omitempty` on its Sandbox), and
    the SDK connects without one (E2B's `test_connect_normalizes_unset_tokens`). No VM: a
    running row, which connect only reads and extends."""
    sid = "i" + secrets.token_hex(4) + "notokens00"
    now = time.time()
    row = SandboxRecord(
        id=sid,
        template="base",
        alias="base",
        state=RowState.RUNNING,
        started_at=now,
        end_at=now + 600,
        cpu=1,
        memory_mb=512,
        disk_mb=1024,
        envd_version="0.6.4",
    )
    on_store(db_path(server), lambda store: store.insert(row))
    try:
        for path in (f"/sandboxes/{sid}/connect", f"/v2/sandboxes/{sid}/connect"):
            resp = api.post(path, json={"timeout": 60})
            assert resp.status_code == 200, resp.text
            body = resp.json()
            assert body["sandboxID"] == sid and body["envdVersion"] == "0.6.4"
            assert not {"envdAccessToken", "trafficAccessToken"} & set(body), body
        sbx = Sandbox.connect(sid, **sdk_opts(server))  # type: ignore[arg-type]
        assert sbx._envd_access_token is None and sbx.traffic_access_token is None
        assert "x-access-token" not in {k.lower() for k in sbx.connection_config.sandbox_headers}
        assert "signature" not in sbx.download_url("test.txt")
    finally:
        assert api.delete(f"/sandboxes/{sid}").status_code == 204


# -- 2 + 3 + 4 on a real sandbox --------------------------------------------------------------

# As root, in the background once the command has answered: SIGSTOP the guest's envd (found
# by its command line; the bracket keeps this shell and grep from matching themselves).
FREEZE_ENVD = (
    "(sleep 1; for p in /proc/[0-9]*; do "
    "tr '\\0' ' ' < $p/cmdline 2>/dev/null | grep -q '[a]gentenv[.]guest[.]envd' "
    "&& kill -STOP ${p#/proc/}; done) >/dev/null 2>&1 &"
)


@pytest.mark.vm
def test_paused_sandbox_pause_body_and_metrics_range_through_the_sdk(
    server: ServerProcess, api: httpx.Client
) -> None:
    opts = sdk_opts(server)
    sbx = Sandbox.create(template="base", timeout=300, **opts)  # type: ignore[arg-type]
    sid = sbx.sandbox_id

    def state() -> str:
        value: str = api.get(f"/sandboxes/{sid}").json()["state"]
        return value

    try:
        # Metrics: only the current sample exists; it is returned when the range holds it.
        now = datetime.now(UTC)
        around = sbx.get_metrics(start=now - timedelta(minutes=5), end=now + timedelta(minutes=5))
        assert len(around) == 1 and around[0].mem_total > 0
        assert len(sbx.get_metrics()) == 1
        assert sbx.get_metrics(start=now - timedelta(hours=2), end=now - timedelta(hours=1)) == []
        assert sbx.get_metrics(start=now + timedelta(hours=1)) == []
        with pytest.raises(SandboxException, match="Invalid time range"):
            sbx.get_metrics(start=now, end=now - timedelta(hours=1))

        assert state() == "running"

        # A strict pause of a guest whose envd answers goes ahead.
        assert sbx.pause(strict=True) is True
        assert state() == "paused"
        # Created without autoResume: the SDK's liveness check (envd /health through the
        # proxy) does not wake it, as on E2B.
        assert api.get(f"/sandboxes/{sid}").json()["lifecycle"]["autoResume"] is False
        assert sbx.is_running() is False
        assert state() == "paused"
        assert api.get(f"/sandboxes/{sid}").json()["pauseMode"] == "full"
        # The v1 resume's autoPause replaces the sandbox's setting.
        resumed = api.post(f"/sandboxes/{sid}/resume", json={"timeout": 300, "autoPause": True})
        assert resumed.status_code == 201, resumed.text
        assert api.get(f"/sandboxes/{sid}").json()["lifecycle"]["onTimeout"] == "pause"
        assert sbx.is_running() is True

        # envd stops answering: a strict pause is refused (503) and the sandbox runs on.
        sbx.commands.run(FREEZE_ENVD, user="root")
        # The freeze runs in the background (the command has to return first): under TCG and
        # a second test worker it can take seconds, so wait until /health stops answering.
        deadline = time.monotonic() + 60
        while True:
            try:
                sbx.is_running(request_timeout=1)
            except TimeoutException:
                break
            assert time.monotonic() < deadline, "envd still answers 60 s after the freeze"
            time.sleep(0.2)
        with pytest.raises(ServiceBusyException, match="does not answer"):
            sbx.pause(strict=True)
        assert state() == "running"
    finally:
        sbx.kill()
