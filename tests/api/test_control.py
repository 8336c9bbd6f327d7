"""The REST control plane over real HTTP: shapes, status codes, errors, keys, idempotency."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime

import httpx
import pytest

from agentenv.api.devserver import ServerProcess
from agentenv.api.keys import KeyRing
from agentenv.orchestrator.store import Store

from .conftest import db_path

SANDBOX_KEYS = {"templateID", "sandboxID", "clientID", "envdVersion", "envdAccessToken"}


def _create(api: httpx.Client, **body: object) -> dict[str, object]:
    resp = api.post("/v2/sandboxes", json={"templateID": "base", **body})
    assert resp.status_code == 201, resp.text
    data: dict[str, object] = resp.json()
    return data


def _assert_error(resp: httpx.Response, status: int) -> dict[str, object]:
    assert resp.status_code == status, resp.text
    assert resp.headers["content-type"].startswith("application/json")
    body = resp.json()
    assert body["code"] == status
    assert isinstance(body["message"], str) and body["message"]
    return body


@pytest.mark.parametrize(
    ("name", "body", "status", "needle"),
    [
        ("malformed json", b'{"templateID": "base",', 400, "not valid JSON"),
        ("unknown field", {"templateID": "base", "colour": "red"}, 400, "unknown field"),
        ("negative timeout", {"templateID": "base", "timeout": -5}, 400, "timeout"),
        ("timeout not int", {"templateID": "base", "timeout": "soon"}, 400, "timeout"),
        ("unknown template", {"templateID": "no-such-template"}, 404, "no-such-template"),
        ("huge metadata", {"templateID": "base", "metadata": {"k": "x" * 10_000}}, 400, "metadata"),
        ("metadata not strings", {"templateID": "base", "metadata": {"k": 1}}, 400, "metadata"),
        ("missing template", {"metadata": {}}, 400, "templateID"),
        ("body is a list", [1, 2], 400, ""),
    ],
)
def test_bad_create_input_is_a_json_4xx(
    api: httpx.Client, name: str, body: object, status: int, needle: str
) -> None:
    if isinstance(body, bytes):
        resp = api.post("/v2/sandboxes", content=body, headers={"content-type": "application/json"})
    else:
        resp = api.post("/v2/sandboxes", json=body)
    err = _assert_error(resp, status)
    assert needle in str(err["message"]), err
    # Nothing was created and the server keeps serving.
    assert api.get("/v2/sandboxes").json() == []
    assert api.get("/health").status_code == 200


def test_api_key_is_required_and_checked(server: ServerProcess) -> None:
    with httpx.Client(base_url=server.url, timeout=10) as client:
        err = _assert_error(client.get("/v2/sandboxes"), 401)
        assert "X-API-Key" in str(err["message"])
        _assert_error(client.get("/v2/sandboxes", headers={"X-API-Key": "aenv_wrong"}), 401)
        _assert_error(
            client.post("/v2/sandboxes", json={"templateID": "base"}, headers={"X-API-Key": ""}),
            401,
        )
        # Health and the OpenAPI document are public.
        assert client.get("/health").status_code == 200
        doc = client.get("/openapi.json").json()
        assert "/v2/sandboxes" in doc["paths"] and "/sandboxes/{sandbox_id}" in doc["paths"]


def test_keys_created_and_revoked_in_the_store_apply_to_the_running_server(
    server: ServerProcess,
) -> None:
    ring = KeyRing(Store(db_path(server)))
    key, secret = ring.create("second")
    with httpx.Client(base_url=server.url, timeout=10) as client:
        assert client.get("/v2/sandboxes", headers={"X-API-Key": secret}).status_code == 200
        ring.revoke(key.id)
        _assert_error(client.get("/v2/sandboxes", headers={"X-API-Key": secret}), 401)
    assert secret not in db_path(server).read_bytes().decode("latin-1")


def test_unknown_routes_and_methods_answer_json(api: httpx.Client) -> None:
    _assert_error(api.get("/nope"), 404)
    _assert_error(api.put("/v2/sandboxes"), 405)
    _assert_error(api.post("/sandboxes/x/snapshots", json={}), 501)


def test_lifecycle_shapes_and_status_codes(api: httpx.Client) -> None:
    before = time.time()
    sbx = _create(api, timeout=120, metadata={"suite": "x y"}, envVars={"FOO": "bar"})
    assert set(sbx) >= SANDBOX_KEYS
    sid = str(sbx["sandboxID"])
    assert sbx["envdAccessToken"]

    info = api.get(f"/sandboxes/{sid}").json()
    assert info["state"] == "running"
    assert info["metadata"] == {"suite": "x y"}
    assert info["lifecycle"] == {"autoResume": False, "onTimeout": "kill"}
    end = datetime.fromisoformat(info["endAt"].replace("Z", "+00:00")).timestamp()
    assert before + 115 < end < time.time() + 125

    # connect extends only; a running sandbox answers 200.
    resp = api.post(f"/v2/sandboxes/{sid}/connect", json={"timeout": 10})
    assert resp.status_code == 200 and resp.json()["sandboxID"] == sid
    end2 = api.get(f"/sandboxes/{sid}").json()["endAt"]
    assert end2 == info["endAt"]
    assert api.post(f"/sandboxes/{sid}/connect", json={}).status_code == 200

    # set_timeout can shorten.
    assert api.post(f"/sandboxes/{sid}/timeout", json={"timeout": 60}).status_code == 204
    end3 = api.get(f"/sandboxes/{sid}").json()["endAt"]
    assert end3 < info["endAt"]
    _assert_error(api.post(f"/sandboxes/{sid}/timeout", json={"timeout": -1}), 400)
    assert api.post(f"/sandboxes/{sid}/refreshes", json={"duration": 30}).status_code == 204

    # No snapshots yet: pause is a clear 501 and the sandbox keeps running.
    err = _assert_error(api.post(f"/sandboxes/{sid}/pause", json={}), 501)
    assert "snapshot" in str(err["message"])
    assert api.get(f"/sandboxes/{sid}").json()["state"] == "running"
    _assert_error(api.post(f"/sandboxes/{sid}/resume", json={}), 409)

    metrics = api.get(f"/sandboxes/{sid}/metrics").json()
    assert len(metrics) == 1 and metrics[0]["memTotal"] > 0

    assert api.delete(f"/sandboxes/{sid}").status_code == 204
    _assert_error(api.delete(f"/sandboxes/{sid}"), 404)
    _assert_error(api.get(f"/sandboxes/{sid}"), 404)
    _assert_error(api.post(f"/sandboxes/{sid}/timeout", json={"timeout": 5}), 404)
    _assert_error(api.post(f"/v2/sandboxes/{sid}/connect", json={}), 404)
    _assert_error(api.post(f"/sandboxes/{sid}/pause", json={}), 404)

    logs = api.get(f"/sandboxes/{sid}/logs").json()
    lines = [e["line"] for e in logs["logs"]]
    assert "running" in lines and "killed" in lines
    assert api.get(f"/v2/sandboxes/{sid}/logs").json()["logs"][0]["fields"]["sandboxID"] == sid
    _assert_error(api.get("/sandboxes/inope/logs"), 404)


def test_v1_create_honours_secure_false(api: httpx.Client) -> None:
    resp = api.post("/sandboxes", json={"templateID": "base", "secure": False, "timeout": 30})
    assert resp.status_code == 201, resp.text
    body = resp.json()
    assert body["envdAccessToken"] is None
    assert api.delete(f"/sandboxes/{body['sandboxID']}").status_code == 204


def test_idempotency_key_returns_the_same_sandbox(api: httpx.Client) -> None:
    body = {"templateID": "base", "timeout": 30, "metadata": {"idem": "1"}}
    first = api.post("/v2/sandboxes", json=body, headers={"Idempotency-Key": "abc-123"})
    again = api.post("/v2/sandboxes", json=body, headers={"Idempotency-Key": "abc-123"})
    assert first.status_code == again.status_code == 201
    assert first.json()["sandboxID"] == again.json()["sandboxID"]
    _assert_error(
        api.post(
            "/v2/sandboxes",
            json={**body, "timeout": 31},
            headers={"Idempotency-Key": "abc-123"},
        ),
        409,
    )
    listed = api.get("/v2/sandboxes", params={"metadata": "idem=1"}).json()
    assert [s["sandboxID"] for s in listed] == [first.json()["sandboxID"]]
    assert api.delete(f"/sandboxes/{first.json()['sandboxID']}").status_code == 204


def test_concurrent_creates_with_one_idempotency_key_make_one_sandbox(
    server: ServerProcess,
) -> None:
    body = {"templateID": "base", "timeout": 30, "metadata": {"idem": "race"}}

    def post() -> httpx.Response:
        with httpx.Client(base_url=server.url, timeout=60) as c:
            return c.post(
                "/v2/sandboxes",
                json=body,
                headers={"X-API-Key": server.api_key, "Idempotency-Key": "race-1"},
            )

    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda _: post(), range(4)))
    assert {r.status_code for r in answers} == {201}
    ids = {r.json()["sandboxID"] for r in answers}
    assert len(ids) == 1
    with httpx.Client(base_url=server.url, headers={"X-API-Key": server.api_key}) as c:
        listed = c.get("/v2/sandboxes", params={"metadata": "idem=race"}).json()
        assert [s["sandboxID"] for s in listed] == list(ids)
        assert c.delete(f"/sandboxes/{ids.pop()}").status_code == 204


def test_list_filters_and_pagination(api: httpx.Client) -> None:
    ids = [
        str(_create(api, timeout=60, metadata={"k": "v w&x", "n": str(i)})["sandboxID"])
        for i in range(3)
    ]
    other = str(_create(api, timeout=60, metadata={"k": "other"})["sandboxID"])
    try:
        # The SDK's triple encoding: urlencode({quote(k): quote(v)}) then httpx encodes it.
        meta = "k=v%20w%26x"
        seen: list[str] = []
        token = None
        for _ in range(5):
            params = {"metadata": meta, "state": "running", "limit": "1"}
            if token:
                params["nextToken"] = token
            resp = api.get("/v2/sandboxes", params=params)
            assert resp.status_code == 200
            seen += [s["sandboxID"] for s in resp.json()]
            token = resp.headers.get("x-next-token")
            if not token:
                break
        assert seen == ids
        assert api.get("/v2/sandboxes", params={"state": "paused"}).json() == []
        desc = api.get("/v2/sandboxes", params={"order": "desc"}).json()
        assert [s["sandboxID"] for s in desc][:4] == [other, *reversed(ids)]
        _assert_error(api.get("/v2/sandboxes", params={"state": "killed"}), 400)
        _assert_error(api.get("/v2/sandboxes", params={"nextToken": "garbage!"}), 400)
        _assert_error(api.get("/v2/sandboxes", params={"limit": "0"}), 400)
        v1 = api.get("/sandboxes", params={"metadata": "k=other"}).json()
        assert [s["sandboxID"] for s in v1] == [other]
    finally:
        for sid in [*ids, other]:
            api.delete(f"/sandboxes/{sid}")


def test_timeout_expiry_kills_the_sandbox(api: httpx.Client) -> None:
    sid = str(_create(api, timeout=1)["sandboxID"])
    lines: list[str] = []
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and "killed on timeout" not in lines:
        time.sleep(0.2)
        lines = [e["line"] for e in api.get(f"/sandboxes/{sid}/logs").json()["logs"]]
    assert "killed on timeout" in lines
    _assert_error(api.get(f"/sandboxes/{sid}"), 404)


def test_templates_and_prometheus_metrics(api: httpx.Client) -> None:
    templates = api.get("/templates").json()
    assert [t["templateID"] for t in templates] == ["base"]
    assert api.get("/templates/base").json()["names"] == ["base"]
    _assert_error(api.get("/templates/nope"), 404)
    _assert_error(api.delete("/templates/nope"), 404)
    text = api.get("/metrics").text
    assert 'agentenv_sandboxes{state="running"}' in text
    assert "agentenv_sandbox_create_seconds_count" in text
    assert "agentenv_proxy_bytes_total" in text
