"""Teams in process: the control app on a real store, a runtime that boots nothing (its
"sandboxes" are rows in a dict; envd is a mock transport). Two teams' keys; every route
family answers another team's sandbox, template or snapshot as one that does not exist.
What a VM and the proxy add is tests/e2e/test_tenants.py."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx
import pytest
from build.fakes import FakeCatalog, FakeRepo, add_build, built_templates, now
from fastapi.testclient import TestClient

from agentenv.api.context import ControlContext
from agentenv.api.control import build_control_app
from agentenv.api.keys import KeyRing
from agentenv.build.templates import DEFAULT_TAG, BuiltTemplates, image_template_name
from agentenv.config import Settings
from agentenv.contract.runtime import (
    Found,
    HostMemory,
    Placement,
    SandboxSpec,
    SnapshotInfo,
    TemplateInfo,
    TemplateUnavailable,
)
from agentenv.control.metrics import Metrics
from agentenv.control.sandboxes import SandboxManager
from agentenv.control.sqlite_store import SqliteStore
from agentenv.control.store import DEFAULT_TEAM, SandboxState
from agentenv.network.egress import Egress
from agentenv.snapshot.errors import SnapshotError


class PaperRuntime:
    """Sandboxes on paper: create/pause/resume/snapshot/fork change a dict, nothing runs."""

    def __init__(self, repo: FakeRepo) -> None:
        self.repo = repo
        self.held: dict[str, str] = {}  # runtime id -> "running" | "paused"
        self.made: list[SnapshotInfo] = []

    def _place(self, rid: str) -> Placement:
        self.held[rid] = "running"
        return Placement(rid, "127.0.0.1", "http://envd.test")

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    async def create(self, spec: SandboxSpec) -> Placement:
        return self._place(spec.sandbox_id)

    async def update_egress(self, sandbox_id: str, egress: Egress) -> None:
        pass

    async def delete(self, sandbox_id: str) -> None:
        self.held.pop(sandbox_id, None)

    async def pause(self, sandbox_id: str, **_: object) -> None:
        self.held[sandbox_id] = "paused"

    async def resume(self, spec: SandboxSpec, *, memory: bool = True) -> Placement:
        self.held[spec.sandbox_id] = "running"
        return Placement(spec.sandbox_id, "127.0.0.1", "http://envd.test")

    async def init_guest(self, spec: SandboxSpec) -> None:
        pass

    async def guest_metrics(self, sandbox_id: str, envd_token: str | None) -> dict[str, Any] | None:
        if self.held.get(sandbox_id) != "running":
            return None
        return {"ts": time.time(), "cpu_count": 1, "mem_total": 1}

    async def guest_health(self, sandbox_id: str) -> str | None:
        return None

    async def is_alive(self, sandbox_id: str) -> bool:
        return sandbox_id in self.held

    async def find(self, sandbox_id: str) -> Found | None:
        state = self.held.get(sandbox_id)
        if state is None:
            return None
        return (
            Found("running", Placement(sandbox_id, "127.0.0.1", "http://envd.test"))
            if (state == "running")
            else Found("paused", None)
        )

    async def sandbox_ids(self) -> list[str]:
        return list(self.held)

    async def lost_reason(self, sandbox_id: str) -> str | None:
        return None

    def watch_lost(self, handler: Callable[[str, str], None]) -> None:
        pass

    async def snapshot(
        self, sandbox_id: str, name: str | None, envd_token: str | None, *, memory: bool = True
    ) -> SnapshotInfo:
        snap = self.repo.add([name] if name else [])
        info = SnapshotInfo(snap.id, snap.names, sandbox_id, time.time(), 1, 512)
        self.made.append(info)
        return info

    async def fork(
        self, sandbox_id: str, children: list[SandboxSpec], envd_token: str | None
    ) -> list[Placement]:
        return [self._place(c.sandbox_id) for c in children]

    async def snapshots(self) -> list[SnapshotInfo]:
        return [replace(s, names=self.repo.get(s.snapshot_id).names) for s in self.made]

    async def remove_image(self, name: str) -> bool:
        return False

    async def gateway(self, node_id: str) -> str | None:
        return None

    def note_activity(self, sandbox_id: str) -> None:
        pass

    async def host_memory(self, sandbox_id: str) -> HostMemory | None:
        if self.held.get(sandbox_id) != "running":
            return None
        return HostMemory(rss=1 << 20, pss=1 << 20, pss_anon=0, pss_file=0, pss_shmem=0)


class SnapshotCatalog(FakeCatalog):
    """Catalog templates, then snapshots by id or name (as `CatalogTemplates`)."""

    def __init__(self, names: list[str], settings: object, repo: FakeRepo) -> None:
        super().__init__(names, settings)
        self.repo = repo

    def info(self, name: str) -> TemplateInfo:
        if name in self.names:
            return super().info(name)
        try:
            snap = self.repo.get(name)
        except SnapshotError as exc:
            raise TemplateUnavailable(name) from exc
        return TemplateInfo(name, 100, snap.created_at, snap.created_at, 1, 512)


@dataclass
class Env:
    store: SqliteStore
    keys: KeyRing
    manager: SandboxManager
    runtime: PaperRuntime
    built: BuiltTemplates
    repo: FakeRepo
    a: TestClient
    b: TestClient
    b_team: str
    app_client: Callable[[str], TestClient]


@pytest.fixture
def env(tmp_path: Path, settings: Settings) -> Iterator[Env]:
    home = tmp_path / "home"
    home.mkdir()
    settings = replace(settings, home=home)
    repo = FakeRepo()
    built = built_templates(home, SnapshotCatalog(["base"], settings, repo), repo)
    store = SqliteStore(home / "db.sqlite")
    runtime = PaperRuntime(repo)
    mgr = SandboxManager(store, runtime, built, envd_version="0.6.4", metrics=Metrics())
    mgr.metrics.watch_states(lambda: mgr.state_counts_seen, lambda: mgr.builds_seen)
    mgr.metrics.watch_host_memory(lambda: mgr.host_memory_seen)
    keys = KeyRing(store)
    _, secret_a = asyncio.run(keys.create("alice"))  # the default team
    team_b = asyncio.run(keys.create_team("bravo"))
    _, secret_b = asyncio.run(keys.create("bob", "bravo"))
    app = build_control_app(ControlContext(mgr, keys, built))
    clients: list[TestClient] = []

    def client(secret: str) -> TestClient:
        c = TestClient(app, headers={"X-API-Key": secret})
        c.__enter__()
        clients.append(c)
        return c

    try:
        yield Env(
            store, keys, mgr, runtime, built, repo, client(secret_a), client(secret_b),
            team_b.id, client,
        )  # fmt: skip
    finally:
        for c in clients:
            c.__exit__(None, None, None)
        asyncio.run(store.close())


def create(c: TestClient, **body: object) -> str:
    r = c.post("/v2/sandboxes", json={"templateID": "base", **body})
    assert r.status_code == 201, r.text
    return str(r.json()["sandboxID"])


def not_found(r: httpx.Response, sandbox_id: str) -> None:
    assert r.status_code == 404, r.text
    assert r.json() == {"code": 404, "message": f"sandbox {sandbox_id!r} not found"}


def test_another_teams_sandbox_is_a_404_on_every_route(env: Env) -> None:
    mine = create(env.a, metadata={"who": "a"})
    theirs = create(env.b)
    made = asyncio.run(env.store.get(mine))
    assert made is not None and made.team_id == DEFAULT_TEAM
    assert asyncio.run(env.store.get(theirs)).team_id == env.b_team  # type: ignore[union-attr]
    # Lists: each team only its own.
    for c, own in ((env.a, mine), (env.b, theirs)):
        assert [s["sandboxID"] for s in c.get("/sandboxes").json()] == [own]
        r = c.get("/v2/sandboxes")
        assert [s["sandboxID"] for s in r.json()] == [own]
        assert r.headers["x-total-running"] == "1"
    assert env.b.get("/v2/sandboxes", params={"metadata": "who=a"}).json() == []
    b = env.b
    never = "i" + uuid.uuid4().hex[:19]
    for sid in (mine, never):
        calls = [
            b.get(f"/sandboxes/{sid}"),
            b.post(f"/sandboxes/{sid}/timeout", json={"timeout": 60}),
            b.post(f"/sandboxes/{sid}/refreshes", json={"duration": 60}),
            b.post(f"/sandboxes/{sid}/pause"),
            b.post(f"/sandboxes/{sid}/resume", json={}),
            b.post(f"/sandboxes/{sid}/connect", json={"timeout": 60}),
            b.post(f"/v2/sandboxes/{sid}/connect", json={"timeout": 60}),
            b.post(f"/sandboxes/{sid}/snapshots", json={}),
            b.post(f"/sandboxes/{sid}/fork", json={"count": 1}),
            b.get(f"/sandboxes/{sid}/metrics"),
            b.get(f"/sandboxes/{sid}/logs"),
            b.get(f"/v2/sandboxes/{sid}/logs"),
            b.put(f"/sandboxes/{sid}/network", json={"allowInternetAccess": False}),
            b.delete(f"/sandboxes/{sid}"),
        ]
        for r in calls:
            # The same answer for another team's id as for one that never existed.
            not_found(r, sid)
    # A's sandbox is untouched and A can still do all of it.
    rec = asyncio.run(env.store.get(mine))
    assert rec is not None and rec.state is SandboxState.RUNNING and rec.end_at == made.end_at
    a = env.a
    assert a.get(f"/sandboxes/{mine}").status_code == 200
    assert a.get(f"/sandboxes/{mine}/metrics").status_code == 200
    assert a.get(f"/sandboxes/{mine}/logs").json()["logs"]
    assert a.post(f"/sandboxes/{mine}/connect", json={"timeout": 60}).status_code == 200
    forked = a.post(f"/sandboxes/{mine}/fork", json={"count": 1})
    assert forked.status_code == 201, forked.text
    child = forked.json()[0]["sandbox"]["sandboxID"]
    assert asyncio.run(env.store.get(child)).team_id == DEFAULT_TEAM  # type: ignore[union-attr]
    assert a.delete(f"/sandboxes/{mine}").status_code == 204
    # B's sandbox survived every call A made to its own.
    assert env.b.get(f"/sandboxes/{theirs}").status_code == 200


def test_metrics_show_only_the_callers_sandboxes(env: Env) -> None:
    mine = create(env.a)
    theirs = create(env.b)
    assert env.app_client("").get("/metrics").status_code == 401
    text_a = env.a.get("/metrics").text
    text_b = env.b.get("/metrics").text
    assert f'sandbox_id="{mine}"' in text_a and f'sandbox_id="{theirs}"' not in text_a
    assert f'sandbox_id="{theirs}"' in text_b and f'sandbox_id="{mine}"' not in text_b
    # Node-wide series stay for every key.
    assert "agentenv_sandboxes" in text_b


def test_snapshots_belong_to_the_team_that_made_them(env: Env) -> None:
    mine = create(env.a)
    theirs = create(env.b)
    r = env.a.post(f"/sandboxes/{mine}/snapshots", json={"name": "golden"})
    assert r.status_code == 201, r.text
    snap = r.json()["snapshotID"]
    assert [s["snapshotID"] for s in env.a.get("/snapshots").json()] == [snap]
    assert env.b.get("/snapshots").json() == []
    assert env.b.get("/snapshots", params={"sandboxID": mine}).json() == []
    for ref in (snap, "golden"):
        r = env.b.post("/v2/sandboxes", json={"templateID": ref})
        assert r.status_code == 404 and ref in r.json()["message"], r.text
        assert env.b.get(f"/templates/{ref}").status_code == 404
        assert env.b.get(f"/templates/aliases/{ref}").status_code == 404
        assert env.b.delete(f"/templates/{ref}").status_code == 404
    assert env.repo.deleted == []
    # Naming B's snapshot like A's would move A's name to it: refused.
    r = env.b.post(f"/sandboxes/{theirs}/snapshots", json={"name": "golden"})
    assert r.status_code == 409, r.text
    assert env.repo.get("golden").id == snap
    # A creates from its snapshot by id and by name.
    create(env.a, templateID=snap)
    create(env.a, templateID="golden")


def test_built_templates_belong_to_their_team(env: Env) -> None:
    # Records from before teams (no team_id) are the default team's: A's.
    add_build(env.built, env.repo, "app", [DEFAULT_TAG])
    build_id = now(env.built.state.template("app")).builds[0]  # type: ignore[union-attr]
    a, b = env.a, env.b
    names_a = {t["templateID"] for t in a.get("/templates").json()}
    names_b = {t["templateID"] for t in b.get("/templates").json()}
    assert names_a == {"base", "app"} and names_b == {"base"}
    assert a.get("/templates/app").status_code == 200
    for path in (
        "/templates/app",
        "/templates/aliases/app",
        "/templates/aliases/app:default",
        f"/templates/app/builds/{build_id}/status",
        f"/templates/app/builds/{build_id}/logs",
        f"/templates/app/builds/{build_id}/progress",
        "/templates/app/builds",
        "/templates/app/tags",
        "/templates/app/files/abc123",
    ):
        assert b.get(path).status_code == 404, path
    assert b.post("/v2/sandboxes", json={"templateID": "app"}).status_code == 404
    assert b.post("/v2/sandboxes", json={"templateID": "app:default"}).status_code == 404
    assert b.post("/templates/tags", json={"target": "app", "tags": ["x"]}).status_code == 404
    r = b.request("DELETE", "/templates/tags", json={"name": "app", "tags": ["x"]})
    assert r.status_code == 404
    assert b.delete("/templates/app").status_code == 404
    assert now(env.built.state.template("app")) is not None
    # One name space: B cannot build into A's name, nor build from A's template.
    r = b.post("/v3/templates", json={"name": "app"})
    assert r.status_code == 409, r.text
    r = b.post("/v3/templates", json={"name": "bapp"})
    assert r.status_code == 202, r.text
    bid = r.json()["buildID"]
    r = b.post(f"/v2/templates/bapp/builds/{bid}", json={"fromTemplate": "app"})
    assert r.status_code == 400 and "fromTemplate" in r.json()["message"], r.text
    assert now(env.built.state.template("bapp")).team_id == env.b_team  # type: ignore[union-attr]
    assert a.get("/templates/bapp").status_code == 404
    assert a.post("/v3/templates", json={"name": "bapp"}).status_code == 409
    # teamID must be the key's own team (E2B's check).
    r = b.post("/v3/templates", json={"name": "bapp", "teamID": DEFAULT_TEAM})
    assert r.status_code == 400 and "mismatch" in r.json()["message"]
    assert b.get("/templates", params={"teamID": DEFAULT_TEAM}).status_code == 400
    assert b.get("/templates", params={"teamID": env.b_team}).status_code == 200
    # The catalog is public: both create from `base`; only the default team deletes it.
    create(b)
    r = b.delete("/templates/base")
    assert r.status_code == 403 and "public" in r.json()["message"]


def test_an_imported_images_entry_is_seen_by_the_teams_that_pulled_it(env: Env) -> None:
    ref = "registry.test/private/app:1"
    image = image_template_name(ref)
    catalog = env.built.inner
    assert isinstance(catalog, FakeCatalog)
    catalog.names.append(image)

    def listed(c: TestClient) -> set[str]:
        return {t["templateID"] for t in c.get("/templates").json()}

    # Pulled by A (the default team, which sees every entry, as before teams).
    assert image in listed(env.a)
    assert image not in listed(env.b)
    assert env.b.post("/v2/sandboxes", json={"templateID": image}).status_code == 404
    assert env.b.get(f"/templates/{image}").status_code == 404
    # A build of B's from that reference that failed (no credentials) shows nothing ...
    r = env.b.post("/v3/templates", json={"name": "mine"})
    assert r.status_code == 202, r.text
    failed = now(env.built.state.build(r.json()["buildID"]))
    assert failed is not None
    now(env.built.state.put_build(replace(failed, status="error", spec={"fromImage": ref})))
    assert image not in listed(env.b)
    # ... a ready one does: B's pull passed the registry's check.
    add_build(env.built, env.repo, "mine", ["v2"], spec={"fromImage": ref})
    assert image in listed(env.b)
    create(env.b, templateID=image)


def test_concurrency_limit_is_a_429_with_retry_after(env: Env) -> None:
    asyncio.run(env.keys.set_limits("bravo", max_sandboxes=2))
    first = create(env.b, timeout=20)
    create(env.b)
    r = env.b.post("/v2/sandboxes", json={"templateID": "base"})
    assert r.status_code == 429, r.text
    assert "maximum number of concurrent sandboxes (2)" in r.json()["message"]
    # The soonest timeout is 20 s away.
    assert 1 <= int(r.headers["retry-after"]) <= 20
    # Nothing was made, and another team is not limited by B's limit.
    assert len(env.b.get("/v2/sandboxes").json()) == 2
    for _ in range(3):
        create(env.a)
    # A fork counts its children.
    assert env.b.post(f"/sandboxes/{first}/fork", json={"count": 1}).status_code == 429
    # A paused sandbox holds no place; resuming it takes one again.
    assert env.b.post(f"/sandboxes/{first}/pause").status_code == 204
    third = create(env.b)
    for path in (f"/sandboxes/{first}/resume", f"/sandboxes/{first}/connect"):
        r = env.b.post(path, json={})
        assert r.status_code == 429 and r.headers["retry-after"], r.text
    assert asyncio.run(env.store.get(first)).state is SandboxState.PAUSED  # type: ignore[union-attr]
    assert env.b.delete(f"/sandboxes/{third}").status_code == 204
    assert env.b.post(f"/sandboxes/{first}/connect", json={}).status_code == 201
    # The limit is read at every request: lifting it applies at once.
    asyncio.run(env.keys.set_limits("bravo", max_sandboxes=0))
    create(env.b)


def test_create_rate_limit_is_a_429_with_retry_after(env: Env) -> None:
    now = [1000.0]
    env.manager.limits._clock = lambda: now[0]
    asyncio.run(env.keys.set_limits("bravo", creates_per_minute=2))
    create(env.b)
    create(env.b)
    r = env.b.post("/v2/sandboxes", json={"templateID": "base"})
    assert r.status_code == 429, r.text
    assert "2 per minute" in r.json()["message"]
    assert r.headers["retry-after"] == "30"
    # A refused create took no token and made nothing.
    assert len(env.b.get("/v2/sandboxes").json()) == 2
    # Another team has its own (unlimited) allowance.
    create(env.a)
    create(env.a)
    create(env.a)
    now[0] += 29
    assert env.b.post("/v2/sandboxes", json={"templateID": "base"}).status_code == 429
    now[0] += 1
    create(env.b)
    assert env.b.post("/v2/sandboxes", json={"templateID": "base"}).status_code == 429


def test_a_revoked_key_gets_401_on_its_next_call(env: Env, tmp_path: Path) -> None:
    key_b2, secret = asyncio.run(env.keys.create("second", "bravo"))
    c = env.app_client(secret)
    sid = create(c)
    assert c.get(f"/sandboxes/{sid}").status_code == 200
    # Revoked from another connection to the same database, as `aenv keys revoke` does.
    other = SqliteStore(env.store.path)
    try:
        asyncio.run(KeyRing(other).revoke(key_b2.id))
    finally:
        asyncio.run(other.close())
    for r in (c.get(f"/sandboxes/{sid}"), c.get("/v2/sandboxes"), c.get("/templates")):
        assert r.status_code == 401, r.text
        assert r.json() == {"code": 401, "message": "invalid API key"}
    # The team's other key still works and still owns the sandbox.
    assert env.b.get(f"/sandboxes/{sid}").status_code == 200
