"""Retention of paused sandboxes on a real server (`AGENTENV_PAUSED_RETENTION`): one past the
limit is deleted with its workdir and the layers only it held; the template and a persistent
snapshot it was the source of stay usable; one within the limit is kept.

The retention counts from the pause (`end_at` becomes the pause time); a timeout set on a
paused sandbox moves that start, so the tests set 0 to start it now, or 600 to keep one.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterator
from datetime import datetime

import httpx
import pytest
from e2b import Sandbox

from agentenv.api.devserver import ServerProcess
from agentenv.rollouts import RolloutError, Rollouts
from agentenv.snapshot.repository import SnapshotRepository
from agentenv.storage.layers import LayerStore
from agentenv.template.datadir import prepare_home

from .conftest import REQUEST_TIMEOUT_S, db_path, on_store, stop_and_check

pytestmark = pytest.mark.vm

RETENTION_S = 4
# Deletion happens on the reaper's next retention check after the limit; bounded well above.
GC_DEADLINE_S = 120.0
NOTE = "/home/user/note.txt"


@pytest.fixture(scope="module")
def short_retention(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    home = prepare_home(tmp_path_factory.mktemp("retention-home"))
    srv = ServerProcess(
        home, ready_timeout_s=180, env={"AGENTENV_PAUSED_RETENTION": str(RETENTION_S)}
    ).start()
    try:
        yield srv
    finally:
        stop_and_check(srv)


@pytest.fixture
def rapi(short_retention: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(
        base_url=short_retention.url,
        headers={"X-API-Key": short_retention.api_key},
        timeout=REQUEST_TIMEOUT_S,
    ) as client:
        yield client


def _sdk(server: ServerProcess) -> dict[str, object]:
    return {
        "api_key": server.api_key,
        "api_url": server.url,
        "sandbox_url": server.url,
        "request_timeout": REQUEST_TIMEOUT_S,
    }


def _error(resp: httpx.Response, status: int) -> str:
    assert resp.status_code == status, resp.text
    assert resp.headers["content-type"].startswith("application/json")
    body = resp.json()
    assert body["code"] == status and isinstance(body["message"], str) and body["message"]
    return str(body["message"])


def _pause(api: httpx.Client, sid: str) -> None:
    resp = api.post(f"/sandboxes/{sid}/pause")
    assert resp.status_code == 204, resp.text


def _runtime_id(server: ServerProcess, sid: str) -> str:
    rec = on_store(db_path(server), lambda store: store.get(sid))
    assert rec is not None
    return rec.id


def _layers(server: ServerProcess) -> LayerStore:
    return LayerStore(server.home / "layers")


def _sole_layers(layers: LayerStore, holder: str) -> set[str]:
    return {d for d in layers.digests() if layers.holders(d) == [holder]}


def _wait_gone(api: httpx.Client, sid: str) -> httpx.Response:
    deadline = time.monotonic() + GC_DEADLINE_S
    while time.monotonic() < deadline:
        resp = api.get(f"/sandboxes/{sid}")
        if resp.status_code == 404:
            return resp
        assert resp.json()["state"] == "paused", resp.text
        time.sleep(0.5)
    raise AssertionError(f"paused sandbox {sid} outlived its retention by {GC_DEADLINE_S} s")


def _kill_quietly(api: httpx.Client, *sids: str) -> None:
    for sid in sids:
        resp = api.delete(f"/sandboxes/{sid}")
        assert resp.status_code in (204, 404), resp.text


def test_paused_past_retention_goes_with_what_only_it_held(
    short_retention: ServerProcess, rapi: httpx.Client
) -> None:
    opts = _sdk(short_retention)
    repo = SnapshotRepository(short_retention.home / "snapshots", _layers(short_retention))
    secret = secrets.token_hex(8)
    snap_name = f"ret-{secrets.token_hex(4)}"
    src = Sandbox.create(template="base", timeout=600, **opts)  # type: ignore[arg-type]
    child_id = ""
    kept_id = ""
    try:
        src.files.write(NOTE, secret)
        resp = rapi.post(f"/sandboxes/{src.sandbox_id}/snapshots", json={"name": snap_name})
        assert resp.status_code == 201, resp.text
        resp = rapi.post(f"/sandboxes/{src.sandbox_id}/fork", json={"count": 1})
        assert resp.status_code == 201, resp.text
        child_id = resp.json()[0]["sandbox"]["sandboxID"]
        for sid in (src.sandbox_id, child_id):
            _pause(rapi, sid)
            # Held past the retention until the checks below are ready (a loaded host can
            # take longer than the 4 s retention to create the next sandbox).
            resp = rapi.post(f"/sandboxes/{sid}/timeout", json={"timeout": 600})
            assert resp.status_code == 204, resp.text
        kept = Sandbox.create(template="base", timeout=600, **opts)  # type: ignore[arg-type]
        kept_id = kept.sandbox_id
        _pause(rapi, kept_id)
        resp = rapi.post(f"/sandboxes/{kept_id}/timeout", json={"timeout": 600})
        assert resp.status_code == 204, resp.text

        doomed = {sid: _runtime_id(short_retention, sid) for sid in (src.sandbox_id, child_id)}
        workdirs = {sid: short_retention.home / "sandboxes" / rid for sid, rid in doomed.items()}
        for wd in workdirs.values():
            assert (wd / "paused.json").is_file(), sorted(p.name for p in wd.iterdir())
        # Once the child paused, the fork's snapshot went; the child alone holds its layer.
        child_layers = _sole_layers(_layers(short_retention), doomed[child_id])
        assert child_layers, "the fork child holds no layer of its own"
        template = next(s for s in repo.list() if any(n.startswith("base.") for n in s.names))
        snap = repo.get(snap_name)
        kept_files = [repo.memory_path(template.id), repo.state_path(template.id)]
        kept_files += [repo.memory_path(snap.id)]
        kept_files += [_layers(short_retention).path(d) for d in [*template.layers, *snap.layers]]

        for sid in doomed:
            resp = rapi.post(f"/sandboxes/{sid}/timeout", json={"timeout": 0})
            assert resp.status_code == 204, resp.text
        for sid in doomed:
            _error(_wait_gone(rapi, sid), 404)
            assert sid in _error(rapi.post(f"/sandboxes/{sid}/resume", json={}), 404)
            _error(rapi.post(f"/sandboxes/{sid}/connect", json={"timeout": 60}), 404)
            assert not workdirs[sid].exists(), sorted(p.name for p in workdirs[sid].iterdir())
        layers = _layers(short_retention)
        for rid in doomed.values():
            assert not [d for d in layers.digests() if rid in layers.holders(d)]
        store_dir = short_retention.home / "layers"
        left = {d for d in child_layers if (store_dir / f"{d}.qcow2").exists()}
        assert not left, f"layers only the deleted child held are still in the store: {left}"
        missing = [str(p) for p in kept_files if not p.exists()]
        assert not missing, f"template or snapshot files went with the sandbox: {missing}"

        # A sandbox within its retention stays paused and resumable.
        assert rapi.get(f"/sandboxes/{kept_id}").json()["state"] == "paused"
        resp = rapi.post(f"/sandboxes/{kept_id}/resume", json={})
        assert resp.status_code == 201, resp.text
        _kill_quietly(rapi, kept_id)

        # The persistent snapshot whose source was deleted still starts, with the source's file.
        from_snap = Sandbox.create(template=snap_name, timeout=120, **opts)  # type: ignore[arg-type]
        try:
            assert from_snap.files.read(NOTE) == secret
        finally:
            from_snap.kill()
        # Fork N from the snapshot in one call (#24), through the project's client for SDK
        # users: each child has the source's file.
        with Rollouts(short_retention.url, short_retention.api_key) as rollouts:
            kids = rollouts.fork_snapshot(snap_name, 2, timeout=120)
            try:
                assert len(set(kids)) == 2
                for kid in kids:
                    child = Sandbox.connect(kid, **opts)  # type: ignore[arg-type]
                    assert child.files.read(NOTE) == secret
            finally:
                assert all(rollouts.kill(kid) for kid in kids)
            with pytest.raises(RolloutError) as err:
                rollouts.fork_snapshot("nope")
            assert err.value.status == 404 and "nope" in err.value.message
            with pytest.raises(RolloutError) as err:
                rollouts.fork_snapshot(snap_name, 0)
            assert err.value.status == 400 and "count" in err.value.message
        fresh = Sandbox.create(template="base", timeout=120, **opts)  # type: ignore[arg-type]
        try:
            assert fresh.commands.run("echo ok").stdout.strip() == "ok"
        finally:
            fresh.kill()
    finally:
        _kill_quietly(rapi, *(s for s in (src.sandbox_id, child_id, kept_id) if s))
        rapi.delete(f"/templates/{snap_name}")


def _wait_state(api: httpx.Client, sid: str, state: str, bound_s: float = GC_DEADLINE_S) -> None:
    deadline = time.monotonic() + bound_s
    while (got := api.get(f"/sandboxes/{sid}").json().get("state")) != state:
        assert time.monotonic() < deadline, f"{sid} is {got}, not {state}, after {bound_s} s"
        time.sleep(0.3)


def test_a_grace_period_pauses_at_the_timeout_for_a_late_scorer_then_deletes(
    short_retention: ServerProcess, rapi: httpx.Client
) -> None:
    """`gracePeriod`: at its timeout the sandbox is paused with its memory, not killed; a
    scorer that reads it during the grace, through the SDK object it already holds (its
    auto-resume is off), finds it as it was: the read resumes it until its grace would have
    ended; once a timeout pause has lasted the grace, it is deleted (the server's retention,
    4 s here, would have been the same: so the grace here is longer, and the check is that
    it outlives the retention)."""
    grace = 7
    resp = rapi.post("/sandboxes", json={"templateID": "base", "timeout": 4, "gracePeriod": grace})
    assert resp.status_code == 201, resp.text
    sid = resp.json()["sandboxID"]
    try:
        scorer = Sandbox.connect(sid, **_sdk(short_retention))  # type: ignore[arg-type]
        scorer.files.write(NOTE, "episode-1")
        _wait_state(rapi, sid, "paused")
        # A read resumes it; what the episode left is there.
        assert scorer.files.read(NOTE) == "episode-1"
        end_at = datetime.fromisoformat(rapi.get(f"/sandboxes/{sid}").json()["endAt"])
        assert end_at.timestamp() <= time.time() + grace + 1
        # Its next timeout pauses it for the grace again (sooner here than the grace left).
        scorer.set_timeout(1)
        _wait_state(rapi, sid, "paused")
        paused_at = time.monotonic()
        logs = rapi.get(f"/sandboxes/{sid}/logs").text
        assert f"grace period ({grace} s)" in logs, logs
        _error(_wait_gone(rapi, sid), 404)
        # Gone after the grace, not after the server's retention (4 s).
        assert time.monotonic() - paused_at > RETENTION_S + 1
    finally:
        _kill_quietly(rapi, sid)
    # Bad input is a 400 naming the field.
    resp = rapi.post("/sandboxes", json={"templateID": "base", "gracePeriod": -1})
    assert "gracePeriod" in _error(resp, 400)


def test_a_keepalive_kills_a_sandbox_whose_client_went_away(
    short_retention: ServerProcess, rapi: httpx.Client
) -> None:
    """`keepalive`: API calls on the sandbox and proxied traffic keep it; silence for the
    keepalive kills it, long before its timeout."""
    keepalive = 4
    resp = rapi.post(
        "/sandboxes", json={"templateID": "base", "timeout": 600, "keepalive": keepalive}
    )
    assert resp.status_code == 201, resp.text
    sid = resp.json()["sandboxID"]
    try:
        sbx = Sandbox.connect(sid, **_sdk(short_retention))  # type: ignore[arg-type]
        start = time.monotonic()
        # Longer than the keepalive, touches: commands through the proxy, then API reads.
        while time.monotonic() - start < keepalive + 1:
            assert sbx.commands.run("true").exit_code == 0
            time.sleep(1.0)
        with Rollouts(short_retention.url, short_retention.api_key) as rollouts:
            while time.monotonic() - start < keepalive + 3:
                assert rollouts.touch(sid) == "running"
                time.sleep(1.0)
        # Then nobody: it goes within the keepalive and the reaper's check.
        deadline = time.monotonic() + GC_DEADLINE_S
        while rapi.get("/v2/sandboxes").json() and any(
            s["sandboxID"] == sid for s in rapi.get("/v2/sandboxes").json()
        ):
            assert time.monotonic() < deadline, "an unattended sandbox outlived its keepalive"
            time.sleep(1.0)
        resp = rapi.get(f"/sandboxes/{sid}")
        assert resp.status_code == 404
    finally:
        _kill_quietly(rapi, sid)
