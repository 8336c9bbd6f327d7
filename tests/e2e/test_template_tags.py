"""`name:tag` through the unmodified SDK, on real VMs: two builds of one template, sandboxes
created from `name` (the default tag) and `name:v2`, tags assigned and removed, the list
routes, and a delete that waits for the template's last sandbox while a snapshot taken from
one of them outlives it.

VMs, one at a time or two: the two build sandboxes, then the sandboxes created from tags.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from api.conftest import REQUEST_TIMEOUT_S, stop_and_check, use_sdk_env
from e2b import Sandbox, SandboxException, Template

from agentenv.api.devserver import ServerProcess
from agentenv.template.datadir import prepare_home

pytestmark = pytest.mark.vm

TIMINGS: dict[str, float] = {}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    home = prepare_home(tmp_path_factory.mktemp("tags-home"))
    env = {"AGENTENV_WARM_LOW": "0", "AGENTENV_WARM_HIGH": "0"}
    srv = ServerProcess(home, env=env, ready_timeout_s=180).start()
    restore_env = use_sdk_env(srv)
    try:
        yield srv
    finally:
        restore_env()
        print(f"template tag timings: {TIMINGS}")
        stop_and_check(srv)


def api(server: ServerProcess) -> httpx.Client:
    return httpx.Client(
        base_url=server.url, headers={"X-API-Key": server.api_key}, timeout=REQUEST_TIMEOUT_S
    )


def aenv(server: ServerProcess, *args: str) -> Any:
    env = {k: v for k, v in os.environ.items() if not k.startswith("E2B_")}
    env.update({"AGENTENV_URL": server.url, "AGENTENV_API_KEY": server.api_key})
    out = subprocess.run(
        [sys.executable, "-m", "agentenv.cli.client", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return json.loads(out.stdout)


def version(text: str) -> Any:
    return Template().from_template("base").run_cmd(f"echo {text} > /home/user/v")


def read_v(sbx: Sandbox) -> str:
    return sbx.files.read("/home/user/v").strip()


def test_tags_resolve_move_and_a_delete_waits_for_users(server: ServerProcess) -> None:
    t0 = time.monotonic()
    v1 = Template.build(version("one"), "app", cpu_count=1, memory_mb=512)
    v2 = Template.build(version("two"), "app:v2", cpu_count=1, memory_mb=512)
    TIMINGS["two_builds_s"] = round(time.monotonic() - t0, 2)
    assert v1.template_id == v2.template_id == "app"
    tags = {t.tag: str(t.build_id) for t in Template.get_tags("app")}
    assert tags == {"default": v1.build_id, "v2": v2.build_id}

    t0 = time.monotonic()
    one = Sandbox.create("app", timeout=300)
    TIMINGS["create_default_s"] = round(time.monotonic() - t0, 2)
    two = Sandbox.create("app:v2", timeout=300)
    try:
        assert (read_v(one), read_v(two)) == ("one", "two")
        with api(server) as c:
            rows = {r["sandboxID"]: r for r in c.get("/v2/sandboxes").json()}
            # As E2B: the template, not the tag; no build sandbox is listed.
            assert set(rows) == {one.sandbox_id, two.sandbox_id}
            for sid in rows:
                assert (rows[sid]["templateID"], rows[sid]["alias"]) == ("app", "app")
            listed = {t["templateID"]: t for t in c.get("/templates").json()}
            assert listed["app"]["buildID"] == v1.build_id
            assert listed["app"]["buildCount"] == 2 and listed["app"]["spawnCount"] == 2
            builds = [b["buildID"] for b in c.get("/templates/app").json()["builds"]]
            assert builds == [v2.build_id, v1.build_id]
            assert c.get("/snapshots").json() == []
        # The CLI shows the same (JSON when piped).
        shown = {t["templateID"]: t for t in aenv(server, "template", "ls")}
        assert shown["app"]["buildID"] == v1.build_id and "base" in shown
        assert {r["sandboxID"] for r in aenv(server, "ls")} == {one.sandbox_id, two.sandbox_id}

        # A tag assigned to v2's build moves there; removed, it resolves no more.
        assigned = Template.assign_tags("app:v2", "prod")
        assert str(assigned.build_id) == v2.build_id
        prod = Sandbox.create("app:prod", timeout=120)
        try:
            assert read_v(prod) == "two"
        finally:
            prod.kill()
        Template.remove_tags("app", "prod")
        with pytest.raises(SandboxException, match=r"404.*tag 'prod'"):
            Sandbox.create("app:prod", timeout=60)

        # E2B refuses to delete a template that running or paused sandboxes use.
        with api(server) as c:
            r = c.delete("/templates/app")
            assert r.status_code == 400 and "running sandboxes" in r.json()["message"]
            two.kill()
            assert one.pause() is True
            r = c.delete("/templates/app")
            assert r.status_code == 400 and "paused sandboxes" in r.json()["message"]
        one = Sandbox.connect(one.sandbox_id, timeout=300)
        assert read_v(one) == "one"
        snap = one.create_snapshot()
    finally:
        one.kill()
        two.kill()

    with api(server) as c:
        assert c.delete("/templates/app").status_code == 204
        assert c.get("/templates/app").status_code == 404
        assert "app" not in {t["templateID"] for t in c.get("/templates").json()}
    assert not Template.exists("app")
    with pytest.raises(SandboxException, match="404"):
        Sandbox.create("app", timeout=60)
    # A snapshot of one of its sandboxes keeps its disk and memory.
    child = Sandbox.create(snap.snapshot_id, timeout=120)
    try:
        assert read_v(child) == "one"
    finally:
        child.kill()
