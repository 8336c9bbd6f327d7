"""`/nodes`: the single-node server's one node (`LocalNodes`), cordons, and the errors."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI, Request, Response
from fastapi.testclient import TestClient

from agentenv.api.nodes import mount_nodes
from agentenv.config import Settings
from agentenv.contract.errors import Unavailable
from agentenv.contract.runtime import SandboxSpec
from agentenv.control.store import DEFAULT_TEAM, ApiKey
from agentenv.node.runtime import LocalNodes, NodeRuntime


def _key(team: str) -> ApiKey:
    return ApiKey(id="k1", name="k", prefix="e2b_", created_at=0.0, revoked_at=None, team_id=team)


@pytest.fixture
def runtime(tmp_path: Path) -> NodeRuntime:
    return NodeRuntime(replace(Settings.from_env(), home=tmp_path / "home"))


def _client(runtime: NodeRuntime, team: str = DEFAULT_TEAM) -> TestClient:
    app = FastAPI()

    async def api_key(request: Request) -> ApiKey:
        return _key(team)

    mount_nodes(app, LocalNodes(runtime), api_key)
    return TestClient(app)


def test_the_single_node_lists_itself_with_its_capacity(runtime: NodeRuntime) -> None:
    with _client(runtime) as c:
        (node,) = c.get("/nodes").json()
        assert node["nodeID"] == "local" and node["state"] == "ready"
        assert node["cpuCount"] >= 1 and node["memoryMB"] > 0
        assert node["freeMemoryMB"] > 0 and node["freeSlots"] > 0
        assert (node["running"], node["paused"]) == (0, 0)
        assert c.get("/nodes/local").json()["nodeID"] == "local"
        missing = c.get("/nodes/other")
        assert missing.status_code == 404 and "other" in missing.json()["message"]


async def test_a_cordoned_node_refuses_creates_with_503(runtime: NodeRuntime) -> None:
    with _client(runtime) as c:
        got: dict[str, Any] = c.post("/nodes/local/cordon", json={"reason": "disk swap"}).json()
        assert got["state"] == "cordoned" and got["cordonReason"] == "disk swap"
        bad = c.post("/nodes/local/cordon", json={"reason": "x", "force": True})
        assert bad.status_code == 400 and "force" in bad.json()["message"]
    with pytest.raises(Unavailable, match="cordoned \\(disk swap\\)") as refused:
        await runtime.create(SandboxSpec("i" + "0" * 19, "base", 1, 512))
    assert refused.value.retry_after
    with _client(runtime) as c:
        assert c.post("/nodes/local/uncordon").json()["state"] == "ready"
    assert runtime.cordon_reason is None


def test_only_the_servers_own_team_changes_a_node(runtime: NodeRuntime) -> None:
    with _client(runtime, team="bravo") as c:
        assert c.get("/nodes").status_code == 200
        refused = c.post("/nodes/local/cordon", json={})
        assert refused.status_code == 403 and refused.json()["code"] == 403
    assert runtime.cordon_reason is None


def test_metrics_carry_a_series_per_node_read_at_each_scrape(
    runtime: NodeRuntime, monkeypatch: pytest.MonkeyPatch
) -> None:
    from prometheus_client import generate_latest

    from agentenv.api import nodes as nodes_api
    from agentenv.control.metrics import Metrics

    monkeypatch.setattr(nodes_api, "NODE_GAUGES_MIN_AGE_S", 0.0)
    app = FastAPI()
    metrics = Metrics()

    async def api_key(request: Request) -> ApiKey:
        return _key(DEFAULT_TEAM)

    @app.get("/metrics")
    async def scrape() -> Response:
        return Response(generate_latest(metrics.registry).decode(), media_type="text/plain")

    directory = LocalNodes(runtime)
    mount_nodes(app, directory, api_key, metrics=metrics)
    with TestClient(app) as c:
        text = c.get("/metrics").text
        assert 'agentenv_node_state{node_id="local",state="ready"} 1.0' in text, text
        assert 'agentenv_node_state{node_id="local",state="cordoned"} 0.0' in text
        assert 'agentenv_node_sandboxes{node_id="local",state="running"} 0.0' in text
        node = c.get("/nodes/local").json()
        assert _gauge(text, "free_slots") == node["freeSlots"] > 0
        assert _gauge(text, "memory_bytes") == node["memoryMB"] << 20
        # Read again at the next scrape: the cordon shows.
        c.post("/nodes/local/cordon", json={"reason": "disk swap"})
        text = c.get("/metrics").text
        assert 'agentenv_node_state{node_id="local",state="cordoned"} 1.0' in text, text

        async def broken() -> list[Any]:
            raise RuntimeError("etcd is away")

        monkeypatch.setattr(directory, "nodes", broken)
        # A listing that fails leaves no node series (not the last ones, as if current).
        text = c.get("/metrics").text
        assert "agentenv_node_state{" not in text and c.get("/metrics").status_code == 200


def _gauge(text: str, name: str) -> float:
    found = re.findall(rf'^agentenv_node_{name}\{{node_id="local"\}} (\S+)$', text, re.M)
    assert len(found) == 1, text
    return float(found[0])
