"""The template routes over built templates, in process: a control app on a real store and
build state, a runtime that boots nothing, an in-memory snapshot repository. What a VM
adds (the create from a tag, pause and resume around a delete) is
tests/e2e/test_template_tags.py."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
from build.fakes import FakeCatalog, FakeRepo, add_build, built_templates, now
from fastapi.testclient import TestClient

from agentenv.api.context import ControlContext
from agentenv.api.control import build_control_app
from agentenv.api.keys import KeyRing
from agentenv.build.templates import DEFAULT_TAG, NO_BUILD, BuiltTemplates, image_template_name
from agentenv.config import Settings
from agentenv.contract.errors import TemplateNotFound
from agentenv.contract.runtime import Placement, SandboxSpec, SnapshotInfo
from agentenv.control.metrics import Metrics
from agentenv.control.sandbox_base import CreateSpec
from agentenv.control.sandboxes import SandboxManager
from agentenv.control.sqlite_store import SqliteStore
from agentenv.control.store import BUILD_METADATA, SandboxRecord, SandboxState, Store
from agentenv.snapshot.errors import SnapshotNotFound


class Refused(Exception):
    pass


class NoVMs:
    """The runtime calls these routes make; `create` records what it was asked for and
    refuses (so no envd is needed)."""

    def __init__(self, repo: FakeRepo) -> None:
        self.created: list[str] = []
        self.listed: list[SnapshotInfo] = []
        # A template's delete drops its snapshots and image through the runtime.
        self.repo = repo
        self.removed: list[str] = []

    async def create(self, spec: SandboxSpec) -> Placement:
        self.created.append(spec.template)
        raise Refused(spec.template)

    async def snapshots(self) -> list[SnapshotInfo]:
        return self.listed

    async def delete_snapshot(self, snapshot_id: str) -> bool:
        try:
            self.repo.delete(snapshot_id)
        except SnapshotNotFound:
            return False
        return True

    async def remove_image(self, name: str) -> bool:
        self.removed.append(name)
        return True

    async def host_memory(self, sandbox_id: str) -> None:
        return None


@dataclass
class Env:
    client: TestClient
    built: BuiltTemplates
    repo: FakeRepo
    store: Store
    runtime: NoVMs
    manager: SandboxManager


@pytest.fixture
def env(tmp_path: Path, settings: Settings) -> Iterator[Env]:
    home = tmp_path / "home"
    home.mkdir()
    settings = replace(settings, home=home)
    repo = FakeRepo()
    built = built_templates(home, FakeCatalog(["base"], settings), repo)
    store = SqliteStore(home / "db.sqlite")
    runtime = NoVMs(repo)
    mgr = SandboxManager(store, runtime, built, envd_version="0.6.4", metrics=Metrics())  # type: ignore[arg-type]
    # As `AgentenvApp` does.
    mgr.metrics.watch_states(lambda: mgr.state_counts_seen, lambda: mgr.builds_seen)
    keys = KeyRing(store)
    _, secret = asyncio.run(keys.create("test"))
    app = build_control_app(ControlContext(mgr, keys, built))
    with TestClient(app, headers={"X-API-Key": secret}) as client:
        yield Env(client, built, repo, store, runtime, mgr)
    asyncio.run(store.close())


def sandbox(
    store: Store,
    template: str,
    state: SandboxState = SandboxState.RUNNING,
    metadata: dict[str, str] | None = None,
) -> SandboxRecord:
    now = time.time()
    rec = SandboxRecord(
        id="i" + uuid.uuid4().hex[:19],
        template=template,
        alias=template,
        state=state,
        started_at=now,
        end_at=now + 300,
        cpu=1,
        memory_mb=512,
        disk_mb=1024,
        envd_version="0.6.4",
        metadata=metadata or {},
        envd_url="http://envd.test",
    )
    # Called from sync tests (the app runs in the TestClient's own loop).
    asyncio.run(store.insert(rec))
    return rec


async def test_create_from_a_tag_asks_the_runtime_for_its_builds_snapshot(env: Env) -> None:
    v1 = add_build(env.built, env.repo, "app", [DEFAULT_TAG])
    v2 = add_build(env.built, env.repo, "app", ["v2"])
    for ref, build in (("app", v1), ("app:v2", v2), ("app:default", v1)):
        with pytest.raises(Exception, match="sandbox creation failed"):
            await env.manager.create(CreateSpec(template=ref))
        assert env.runtime.created[-1] == build.snapshot_id
        row = (await env.store.select())[-1]
        # E2B reports the template, not the tag.
        assert (row.template, row.alias) == ("app", "app")
    with pytest.raises(TemplateNotFound):
        await env.manager.create(CreateSpec(template="app:v3"))
    assert len(env.runtime.created) == 3


def test_unknown_tag_is_a_404_like_an_unknown_template(env: Env) -> None:
    add_build(env.built, env.repo, "app", [DEFAULT_TAG])
    for ref in ("app:v3", "nope", "base:v1"):
        r = env.client.post("/sandboxes", json={"templateID": ref})
        assert r.status_code == 404, r.text
        assert set(r.json()) == {"code", "message"}
    assert env.runtime.created == []


def test_tags_move_and_go(env: Env) -> None:
    v1 = add_build(env.built, env.repo, "app", [DEFAULT_TAG])
    v2 = add_build(env.built, env.repo, "app", ["v2"])
    c = env.client
    r = c.post("/templates/tags", json={"target": "app:v2", "tags": ["prod", "Stable"]})
    assert r.status_code == 201, r.text
    assert r.json() == {"tags": ["prod", "stable"], "buildID": v2.build_id}
    assert asyncio.run(env.built.get("app:prod")).ref == v2.snapshot_id
    # `name` alone is `name:default`; assigning moves a tag.
    r = c.post("/templates/tags", json={"target": "app", "tags": ["prod"]})
    assert r.status_code == 201 and r.json()["buildID"] == v1.build_id
    assert asyncio.run(env.built.get("app:prod")).ref == v1.snapshot_id
    rows = {row["tag"]: row["buildID"] for row in c.get("/templates/app/tags").json()}
    assert rows == {"default": v1.build_id, "v2": v2.build_id, "prod": v1.build_id,
                    "stable": v2.build_id}  # fmt: skip

    r = c.request("DELETE", "/templates/tags", json={"name": "app", "tags": ["prod", "nope"]})
    assert r.status_code == 204, r.text
    assert c.post("/sandboxes", json={"templateID": "app:prod"}).status_code == 404
    for body, status in (
        ({"name": "app", "tags": ["default"]}, 400),
        ({"name": "app:v2", "tags": ["v2"]}, 400),
        ({"name": "app", "tags": []}, 400),
        ({"name": "nope", "tags": ["v2"]}, 404),
    ):
        r = c.request("DELETE", "/templates/tags", json=body)
        assert r.status_code == status, (body, r.text)
    for body, status in (
        ({"target": "app:v9", "tags": ["x"]}, 404),
        ({"target": "nope", "tags": ["x"]}, 404),
        ({"target": "app", "tags": []}, 400),
        ({"target": "app", "tags": ["a b"]}, 400),
        ({"target": "app", "tags": [str(uuid.uuid4())]}, 400),
    ):
        r = c.post("/templates/tags", json=body)
        assert r.status_code == status, (body, r.text)


def test_aliases_follow_e2b(env: Env) -> None:
    add_build(env.built, env.repo, "app", ["v2"])
    add_build(env.built, env.repo, "pending", [DEFAULT_TAG], status="building")
    c = env.client
    # The name exists from the first build request on; an explicit tag needs a ready build.
    assert c.get("/templates/aliases/app").json() == {"templateID": "app", "public": False}
    assert c.get("/templates/aliases/pending").status_code == 200
    assert c.get("/templates/aliases/app:v2").status_code == 200
    r = c.get("/templates/aliases/app:default")
    assert r.status_code == 404 and "tag 'default'" in r.json()["message"]
    assert c.get("/templates/aliases/pending:default").status_code == 404
    assert c.get("/templates/aliases/base").status_code == 200
    assert c.get("/templates/aliases/nope").status_code == 404


def test_built_templates_are_listed_with_their_builds(env: Env) -> None:
    old = add_build(env.built, env.repo, "app", [DEFAULT_TAG])
    new = add_build(env.built, env.repo, "app", [DEFAULT_TAG])
    failed = add_build(env.built, env.repo, "app", ["v3"], status="error")
    add_build(env.built, env.repo, "pending", [DEFAULT_TAG], status="building")
    sandbox(env.store, "app", SandboxState.GONE)
    last = sandbox(env.store, "app")
    sandbox(env.store, "app", metadata={BUILD_METADATA: new.build_id})  # not a spawn
    c = env.client
    rows = {row["templateID"]: row for row in c.get("/templates").json()}
    assert set(rows) == {"base", "app", "pending"}
    app = rows["app"]
    assert app["buildID"] == new.build_id
    assert (app["cpuCount"], app["memoryMB"], app["diskSizeMB"]) == (2, 768, 100)
    assert app["names"] == app["aliases"] == ["app"]
    assert app["buildCount"] == 3 and app["buildStatus"] == "ready"
    assert app["envdVersion"] == "0.6.4" and app["public"] is False
    assert app["spawnCount"] == 2 and app["lastSpawnedAt"].startswith(
        time.strftime("%Y-%m-%dT", time.gmtime(last.started_at))
    )
    pending = rows["pending"]
    assert pending["buildID"] == NO_BUILD and pending["buildStatus"] == "building"
    assert (pending["cpuCount"], pending["memoryMB"], pending["envdVersion"]) == (0, 0, "")
    assert rows["base"]["spawnCount"] == 0

    body = c.get("/templates/app").json()
    assert [b["buildID"] for b in body["builds"]] == [
        failed.build_id,
        new.build_id,
        old.build_id,
    ]
    ready = body["builds"][1]
    assert ready["status"] == "ready" and ready["cpuCount"] == 2 and ready["diskSizeMB"] == 100
    assert "finishedAt" in ready and ready["envdVersion"] == "0.6.4"
    assert body["builds"][0]["status"] == "error"
    r = c.get("/templates/app", params={"limit": 2})
    assert len(r.json()["builds"]) == 2
    rest = c.get("/templates/app", params={"nextToken": r.headers["x-next-token"]}).json()
    assert [b["buildID"] for b in rest["builds"]] == [old.build_id]
    assert c.get("/templates/app:v3").json()["templateID"] == "app"


def test_build_sandboxes_are_not_listed(env: Env) -> None:
    mine = sandbox(env.store, "base")
    sandbox(env.store, "base", metadata={BUILD_METADATA: str(uuid.uuid4())})
    sandbox(env.store, "base", SandboxState.PAUSED, metadata={BUILD_METADATA: "x"})
    c = env.client
    r = c.get("/v2/sandboxes")
    assert [row["sandboxID"] for row in r.json()] == [mine.id]
    assert r.headers["x-total-running"] == "1"
    assert [row["sandboxID"] for row in c.get("/sandboxes").json()] == [mine.id]
    assert [row["sandboxID"] for row in c.get("/v2/sandboxes?state=paused").json()] == []
    # The operator's gauges: users' sandboxes, and build sandboxes apart.
    text = c.get("/metrics").text
    assert 'agentenv_sandboxes{state="running"} 1.0' in text
    assert 'agentenv_sandboxes{state="paused"} 0.0' in text
    assert "agentenv_build_sandboxes 2.0" in text
    # Users cannot make one.
    r = c.post("/sandboxes", json={"templateID": "base", "metadata": {BUILD_METADATA: "x"}})
    assert r.status_code == 400 and BUILD_METADATA in r.json()["message"]


def test_the_builders_snapshots_are_hidden(env: Env) -> None:
    rec = add_build(env.built, env.repo, "app", [DEFAULT_TAG])
    assert rec.snapshot_id is not None
    cache = env.repo.add(["build-cache-" + "1" * 40])
    mine = env.repo.add(["mine"])
    env.runtime.listed = [
        SnapshotInfo(s.id, s.names, "rt", 1.0, 1, 512)
        for s in (env.repo.get(rec.snapshot_id), cache, mine)
    ]
    c = env.client
    assert c.get("/snapshots").json() == [{"snapshotID": mine.id, "names": ["mine"]}]
    for ref in (rec.snapshot_id, cache.id, cache.names[0]):
        assert c.post("/sandboxes", json={"templateID": ref}).status_code == 404
        assert c.delete(f"/templates/{ref}").status_code == 404
        assert c.get(f"/templates/{ref}").status_code == 404
        assert c.get(f"/templates/aliases/{ref}").status_code == 404
    assert env.runtime.created == []
    assert env.repo.deleted == []
    for name, status in (("build-cache-x", 400), ("build-final-x", 400), ("app", 409)):
        r = c.post("/sandboxes/whatever/snapshots", json={"name": name})
        assert r.status_code == status, r.text


def test_delete_is_refused_while_sandboxes_use_it(env: Env) -> None:
    add_build(env.built, env.repo, "app", [DEFAULT_TAG])
    c = env.client
    live = sandbox(env.store, "app")
    r = c.delete("/templates/app")
    assert r.status_code == 400 and "running sandboxes" in r.json()["message"]
    asyncio.run(env.store.update(live.id, state=SandboxState.PAUSED))
    r = c.delete("/templates/app:v2")
    assert r.status_code == 400 and "paused sandboxes" in r.json()["message"]
    asyncio.run(env.store.update(live.id, state=SandboxState.GONE))
    # A build sandbox from it is the builder's, not a user of the template.
    sandbox(env.store, "app", metadata={BUILD_METADATA: "b"})
    assert c.delete("/templates/app").status_code == 204
    assert c.get("/templates/app").status_code == 404
    assert c.post("/sandboxes", json={"templateID": "app"}).status_code == 404
    # The catalog's templates follow the same rule.
    sandbox(env.store, "base", SandboxState.PAUSED)
    assert c.delete("/templates/base").status_code == 400


def test_delete_releases_only_what_no_other_template_uses(env: Env) -> None:
    removed = env.runtime.removed
    shared = env.repo.add(["build-final-" + "2" * 40])
    image: dict[str, Any] = {"fromImage": "registry.test/app:1", "steps": []}
    a1 = add_build(env.built, env.repo, "a", [DEFAULT_TAG], spec=image)
    a2 = add_build(env.built, env.repo, "a", ["v2"], snapshot=shared)
    failed = add_build(env.built, env.repo, "a", ["v3"], status="error")
    # An identical build of another template reuses the same snapshot (the step cache).
    add_build(env.built, env.repo, "b", [DEFAULT_TAG], snapshot=shared, spec=image)
    mine = env.repo.add(["mine"])
    # Builds made before tags resolved through the records also named their snapshot.
    shared.names.append("a")
    assert env.client.delete("/templates/a").status_code == 204
    assert env.repo.deleted == [a1.snapshot_id]
    assert set(env.repo.snaps) == {shared.id, mine.id}
    assert "a" not in shared.names
    assert env.client.post("/sandboxes", json={"templateID": "a"}).status_code == 404
    assert env.runtime.created == []
    for rec in (a1, a2, failed):
        assert now(env.built.state.build(rec.build_id)) is None
    assert asyncio.run(env.built.get("b")).ref == shared.id
    r = env.client.post("/templates/tags", json={"target": "a", "tags": ["x"]})
    assert r.status_code == 404
    # b's image goes with b, unless a sandbox still runs from the image template.
    assert removed == []
    user = sandbox(env.store, image_template_name("registry.test/app:1"))
    assert env.client.delete("/templates/b").status_code == 204
    assert removed == [] and env.repo.deleted == [a1.snapshot_id, shared.id]
    asyncio.run(env.store.update(user.id, state=SandboxState.GONE))
    add_build(env.built, env.repo, "c", [DEFAULT_TAG], spec=image)
    assert env.client.delete("/templates/c").status_code == 204
    assert removed == [image_template_name("registry.test/app:1")]
