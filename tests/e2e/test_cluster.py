"""Many nodes on one machine: three node agents (`aenv node`, each its own data dir, slot range
and id), a control plane on a 3-member etcd, driven through the official SDK.

Creates spread over the nodes (placement), every sandbox answers through the control plane's
proxy, `GET /nodes` and the list show all of them; a cordoned node takes no new sandboxes; a
SIGKILLed agent's running sandboxes are reported lost with the reason while creates keep
succeeding on the others."""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from api.conftest import stop_and_check
from cluster.etcd_cluster import EtcdCluster
from cluster_procs import NodeProcess, cluster_env, replica
from e2b import Sandbox, Template, wait_for_port
from objstore.seaweed import SeaweedFS
from oci.images import Pusher
from oci.registry import REGISTRY_BIN, Registry
from proxy.conftest import APP, GUEST_LIB, HTTP_PORT, WS_PORT, wait_port, websockets_tarball
from template.imagebuild import push_busybox
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect as ws_sync_connect

from agentenv.template.datadir import prepare_home
from agentenv.vmm.registry import VMRecord, load_all

pytestmark = pytest.mark.vm

NODES = ("node-a", "node-b", "node-c")
# Each node its own part of the default slot range (guests of one cannot reach another's).
SLOT_CIDRS = ("198.18.64.0/20", "198.18.80.0/20", "198.18.96.0/20")
RT = 180  # SDK request timeout, s: a create under TCG on a busy 2-core host
LEASE_GONE_S = 30.0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    root = tmp_path_factory.mktemp("cluster")
    with EtcdCluster(root / "etcd") as etcd, SeaweedFS() as s3:
        env = cluster_env(etcd.endpoints, secrets.token_urlsafe(16), f"/c{uuid.uuid4().hex[:8]}/")
        env.update(s3.env(f"c{uuid.uuid4().hex[:8]}"))
        nodes = [
            NodeProcess(root / n, n, cidr, env) for n, cidr in zip(NODES, SLOT_CIDRS, strict=True)
        ]
        servers: list[Any] = []
        try:
            for node in nodes:
                node.start()
            for i in range(2):
                # Replica 1 holds no template of its own: `base` is what the nodes publish.
                home = root / f"control-{i}"
                if i == 0:
                    prepare_home(home)
                else:
                    home.mkdir()
                if servers:
                    # One store (etcd) for both: the first replica made the first key.
                    (home / "api-key").write_text(servers[0].api_key)
                    (home / "api-key").chmod(0o600)
                servers.append(replica(home, env).start())
            yield {"etcd": etcd, "nodes": nodes, "server": servers[0], "servers": servers,
                   "env": env}  # fmt: skip
        finally:
            for server in servers:
                stop_and_check(server)
            for node in nodes:
                node.stop()


def _api(server: Any) -> httpx.Client:
    return httpx.Client(
        base_url=server.url, headers={"X-API-Key": server.api_key}, timeout=60, trust_env=False
    )


def _nodes(server: Any) -> dict[str, dict[str, Any]]:
    with _api(server) as api:
        resp = api.get("/nodes")
        assert resp.status_code == 200, resp.text
        return {n["nodeID"]: n for n in resp.json()}


def _bound_node(server: Any, sandbox_id: str, nodes: list[NodeProcess]) -> str:
    """The node whose data dir holds the sandbox."""
    held = [n.node_id for n in nodes if (n.home / "sandboxes" / sandbox_id).is_dir()]
    assert len(held) == 1, f"{sandbox_id} is on {held}"
    return held[0]


def _create(monkeypatch: pytest.MonkeyPatch, server: Any, **kw: Any) -> Sandbox:
    for k, v in server.sdk_env().items():
        monkeypatch.setenv(k, v)
    return Sandbox.create(template="base", timeout=600, request_timeout=RT, **kw)


def test_creates_spread_and_answer_through_the_control_plane(
    cluster: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    server, nodes = cluster["server"], cluster["nodes"]
    listed = _nodes(server)
    assert sorted(listed) == list(NODES) and all(n["state"] == "ready" for n in listed.values())
    boxes = [_create(monkeypatch, server, metadata={"i": str(i)}) for i in range(4)]
    try:
        where = {b.sandbox_id: _bound_node(server, b.sandbox_id, nodes) for b in boxes}
        # Best of K by free memory and load: four creates do not all land on one node.
        assert len(set(where.values())) >= 2, where
        for b in boxes:
            out = b.commands.run("hostname; echo $((6*7))", request_timeout=RT)
            assert out.stdout.split() == [b.sandbox_id, "42"]
        # The cluster-wide list and the node counts see every one of them.
        pager = Sandbox.list(limit=100, request_timeout=RT)
        listed_ids = {s.sandbox_id for s in pager.next_items()}
        assert {b.sandbox_id for b in boxes} <= listed_ids
        counts = {k: v["running"] for k, v in _wait_counts(server, where).items()}
        for node_id in set(where.values()):
            assert counts[node_id] == sum(1 for n in where.values() if n == node_id)
        # Prometheus, from either replica: every sandbox's host memory (asked of its node)
        # and the cluster-wide count of running ones.
        for replica_server in cluster["servers"]:
            with _api(replica_server) as api:
                metrics = api.get("/metrics").text
            for b in boxes:
                assert f'sandbox_id="{b.sandbox_id}"' in metrics, metrics[-2000:]
            running = re.search(r'^agentenv_sandboxes\{state="running"\} (\d+)', metrics, re.M)
            assert running is not None and int(float(running.group(1))) >= len(boxes)
            # A series per node, as `GET /nodes` has it (read again at each scrape).
            for node_id in NODES:
                node = _node_series(metrics, node_id)
                assert node['state{state="ready"}'] == 1 and node['state{state="cordoned"}'] == 0
                assert node["cpus"] >= 1 and node["memory_bytes"] >= node["free_memory_bytes"] > 0
                assert node["slots"] >= node["free_slots"] > 0
                assert node['sandboxes{state="running"}'] == counts.get(node_id, 0), node
        # A reset, through the other replica, runs in place on the sandbox's node (the node
        # RPC's Reset): same node and network slot, a new QEMU, the guest back at `base`.
        b = boxes[0]
        home = next(n.home for n in nodes if n.node_id == where[b.sandbox_id])
        before = _vm_of(home, b.sandbox_id)
        workdir = (home / "sandboxes" / b.sandbox_id).stat().st_ino
        b.files.write("/home/user/episode.txt", "step", request_timeout=RT)
        with _api(cluster["servers"][-1]) as api:
            resp = api.post(f"/sandboxes/{b.sandbox_id}/reset")
        assert resp.status_code == 200, resp.text
        assert _bound_node(server, b.sandbox_id, nodes) == where[b.sandbox_id]
        after = _vm_of(home, b.sandbox_id)
        assert after.pid != before.pid and after.spec["netns"] == before.spec["netns"]
        # Not a delete and a create (which would make the sandbox's workdir anew).
        assert (home / "sandboxes" / b.sandbox_id).stat().st_ino == workdir
        assert not b.files.exists("/home/user/episode.txt", request_timeout=RT)
        assert b.commands.run("hostname", request_timeout=RT).stdout.strip() == b.sandbox_id
    finally:
        for b in boxes:
            b.kill(request_timeout=RT)


def _vm_of(home: Path, sandbox_id: str) -> VMRecord:
    (found,) = [r for r in load_all(home / "run" / "vms") if r.name == sandbox_id]
    return found


def _wait_ready(server: Any, node_ids: tuple[str, ...], within_s: float = 60.0) -> None:
    deadline = time.monotonic() + within_s
    while True:
        listed = _nodes(server)
        if all(listed.get(n, {}).get("state") == "ready" for n in node_ids):
            return
        assert time.monotonic() < deadline, listed
        time.sleep(0.5)


def _node_series(metrics: str, node_id: str) -> dict[str, float]:
    """`agentenv_node_<name>{node_id="<node_id>"[,<labels>]} <value>` as {name[{labels}]: value}."""
    out: dict[str, float] = {}
    pattern = rf'^agentenv_node_(\w+)\{{node_id="{re.escape(node_id)}"(?:,([^}}]*))?\}} (\S+)$'
    for name, labels, value in re.findall(pattern, metrics, re.M):
        out[f"{name}{{{labels}}}" if labels else name] = float(value)
    return out


def _wait_counts(server: Any, where: dict[str, str]) -> dict[str, dict[str, Any]]:
    """`GET /nodes` once every node's published load has caught up with `where`."""
    want: dict[str, int] = {}
    for node_id in where.values():
        want[node_id] = want.get(node_id, 0) + 1
    deadline = time.monotonic() + 20
    while True:
        listed = _nodes(server)
        if all(listed[n]["running"] == c for n, c in want.items()):
            return listed
        assert time.monotonic() < deadline, f"node counts {listed} never matched {want}"
        time.sleep(0.5)


def test_concurrent_callers_through_both_replicas(cluster: dict[str, Any]) -> None:
    """Four threads, two per replica, each its own SDK client: create, run, pause, resume
    through the other replica, kill. Every one ends as it should; nothing is left."""
    servers = cluster["servers"]

    def one(i: int) -> str:
        here, there = servers[i % 2], servers[(i + 1) % 2]
        opts: dict[str, Any] = {"api_key": here.api_key, "api_url": here.url,
                                "sandbox_url": here.url}  # fmt: skip
        sbx = Sandbox.create("base", timeout=600, request_timeout=RT, **opts)
        try:
            out = sbx.commands.run(f"echo {i} > /home/user/i; cat /home/user/i",
                                   request_timeout=RT)  # fmt: skip
            assert out.stdout.strip() == str(i)
            sbx.pause(request_timeout=RT)
            other: dict[str, Any] = {"api_key": there.api_key, "api_url": there.url,
                                     "sandbox_url": there.url}  # fmt: skip
            back = Sandbox.connect(sbx.sandbox_id, request_timeout=RT, **other)
            assert back.files.read("/home/user/i").strip() == str(i)
        finally:
            sbx.kill(request_timeout=RT)
        return sbx.sandbox_id

    with ThreadPoolExecutor(max_workers=4) as pool:
        ids = list(pool.map(one, range(4)))
    assert len(set(ids)) == 4
    with _api(servers[0]) as api:
        listed = {s["sandboxID"] for s in api.get("/v2/sandboxes").json()}
    assert not set(ids) & listed
    for node in cluster["nodes"]:
        left = [i for i in ids if (node.home / "sandboxes" / i).exists()]
        assert not left, (node.node_id, left)


def _tunnels(server: Any) -> dict[str, float]:
    """The replica's `agentenv_proxy_tunnels_total` per gateway."""
    with _api(server) as api:
        metrics = api.get("/metrics").text
    found = re.findall(r'^agentenv_proxy_tunnels_total\{gateway="([^"]+)"\} (\S+)$', metrics, re.M)
    return {gateway: float(value) for gateway, value in found}


def test_guest_ports_are_reached_through_the_node_gateway_from_either_replica(
    cluster: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A user's HTTP server and WebSocket echo in the guest, reached through both replicas:
    each replica's proxy opens its connections as tunnels through the data gateway of the
    sandbox's node (as it must when the node is another host), never at the slot address."""
    servers, nodes = cluster["servers"], cluster["nodes"]
    before = [_tunnels(s) for s in servers]
    sbx = _create(monkeypatch, servers[0])
    try:
        node_id = _bound_node(servers[0], sbx.sandbox_id, nodes)
        sbx.files.write(f"{GUEST_LIB}.tgz", websockets_tarball(), request_timeout=RT)
        sbx.files.write(f"{GUEST_LIB}/app.py", APP, request_timeout=RT)
        sbx.commands.run(f"tar -xzf {GUEST_LIB}.tgz -C {GUEST_LIB}", request_timeout=RT)
        sbx.commands.run(
            f"python3 {GUEST_LIB}/app.py 0.0.0.0 {HTTP_PORT} {WS_PORT}",
            background=True,
            timeout=0,
            envs={"PYTHONPATH": GUEST_LIB},
            request_timeout=RT,
        )
        payload = os.urandom(2 * 1024 * 1024)
        for server in servers:
            headers = {"e2b-sandbox-id": sbx.sandbox_id, "e2b-sandbox-port": str(HTTP_PORT)}
            with httpx.Client(base_url=server.url, timeout=60, trust_env=False) as client:
                wait_port(client, headers, "/ready")
                wait_port(client, {**headers, "e2b-sandbox-port": str(WS_PORT)})
                up = client.post("/upload", content=payload, headers=headers)
                assert up.status_code == 200, up.text
                assert up.json()["bytes"] == len(payload)
            url = server.url.replace("http://", "ws://") + "/"
            ws_headers = {"e2b-sandbox-id": sbx.sandbox_id, "e2b-sandbox-port": str(WS_PORT)}
            with ws_sync_connect(url, additional_headers=ws_headers, open_timeout=30) as ws:
                for i in range(3):
                    ws.send(f"hello {i}")
                    assert ws.recv(timeout=30) == f"hello {i}"
                big = os.urandom(300_000)
                ws.send(big)
                assert ws.recv(timeout=30) == big
        # Both replicas went through exactly one gateway for it: its node's.
        for server, was in zip(servers, before, strict=True):
            grew = {g: v - was.get(g, 0.0) for g, v in _tunnels(server).items()}
            used = [g for g, d in grew.items() if d > 0]
            assert len(used) == 1, grew
        # The one the node publishes (`GET /nodes`), not the sandbox's slot address.
        assert _nodes(servers[1])[node_id]["gateway"] == used[0]
        # A WebSocket open through replica 1 while replica 0 pauses the sandbox: its node
        # cuts the tunnel (a frozen guest would never answer), so it ends, and soon.
        url = servers[1].url.replace("http://", "ws://") + "/"
        ws_headers = {"e2b-sandbox-id": sbx.sandbox_id, "e2b-sandbox-port": str(WS_PORT)}
        with ws_sync_connect(url, additional_headers=ws_headers, open_timeout=30) as ws:
            ws.send("before the pause")
            assert ws.recv(timeout=30) == "before the pause"
            sbx.pause(request_timeout=RT)
            t0 = time.monotonic()
            with pytest.raises(ConnectionClosed):
                ws.recv(timeout=30)
            print(f"\nwebsocket through the other replica ended {time.monotonic() - t0:.2f}s "
                  "after the pause returned")  # fmt: skip
        # Ended by its node's gateway, not by chance.
        node = next(n for n in nodes if n.node_id == node_id)
        assert f"tunnel(s) of sandbox {sbx.sandbox_id}: it no longer runs here" in (
            node.log_path.read_text(errors="replace")
        )
    finally:
        sbx.kill(request_timeout=RT)


def test_a_cordoned_node_takes_no_new_sandboxes(
    cluster: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    server, nodes = cluster["server"], cluster["nodes"]
    with _api(server) as api:
        for n in NODES[:2]:
            resp = api.post(f"/nodes/{n}/cordon", json={"reason": "maintenance"})
            assert resp.status_code == 200 and resp.json()["state"] == "cordoned", resp.text
        bad = api.post(f"/nodes/{NODES[0]}/cordon", json={"reason": "x", "drain": True})
        assert bad.status_code == 400 and "drain" in bad.json()["message"]
        assert api.post("/nodes/nope/cordon", json={}).status_code == 404
    boxes: list[Sandbox] = []
    try:
        boxes = [_create(monkeypatch, server) for _ in range(2)]
        assert {_bound_node(server, b.sandbox_id, nodes) for b in boxes} == {NODES[2]}
    finally:
        for b in boxes:
            b.kill(request_timeout=RT)
        with _api(server) as api:
            for n in NODES[:2]:
                assert api.post(f"/nodes/{n}/uncordon").json()["state"] == "ready"


def _only_on(server: Any, node_id: str) -> None:
    """Cordon every node but `node_id` (the next create lands there)."""
    with _api(server) as api:
        for n in NODES:
            path = "uncordon" if n == node_id else "cordon"
            assert api.post(f"/nodes/{n}/{path}", json=None).status_code == 200


def _uncordon_all(server: Any) -> None:
    with _api(server) as api:
        for n in NODES:
            api.post(f"/nodes/{n}/uncordon")


def _mark(sbx: Sandbox) -> str:
    """A file on disk, one in RAM (/dev/shm) and a process; returns the process id."""
    sbx.files.write("/home/user/disk.txt", "on disk")
    sbx.commands.run("echo in-ram > /dev/shm/ram.txt", request_timeout=RT)
    return sbx.commands.run(
        "sleep 100000 >/dev/null 2>&1 & echo $!", request_timeout=RT
    ).stdout.strip()


def _check_marks(sbx: Sandbox, pid: str) -> None:
    assert sbx.files.read("/home/user/disk.txt") == "on disk"
    out = sbx.commands.run(f"cat /dev/shm/ram.txt; kill -0 {pid} && echo alive", request_timeout=RT)
    assert out.stdout.split() == ["in-ram", "alive"], out


def test_paused_on_a_cordoned_node_resumes_on_another_with_its_memory(
    cluster: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    server, nodes = cluster["server"], cluster["nodes"]
    _only_on(server, NODES[1])
    try:
        sbx = _create(monkeypatch, server)
    finally:
        _uncordon_all(server)
    try:
        assert _bound_node(server, sbx.sandbox_id, nodes) == NODES[1]
        pid = _mark(sbx)
        sbx.pause(request_timeout=RT)
        with _api(server) as api:
            # Forked while paused, through its node agent (#24): the child runs there with
            # the parent's files, RAM and processes; the parent stays paused.
            resp = api.post(f"/sandboxes/{sbx.sandbox_id}/fork", json={"count": 1})
            assert resp.status_code == 201, resp.text
            kid = resp.json()[0]["sandbox"]["sandboxID"]
            try:
                assert _bound_node(server, kid, nodes) == NODES[1]
                child = Sandbox.connect(kid, request_timeout=RT)
                _check_marks(child, pid)
                # Its reset goes back to the fork's state (the capture on its node), not to
                # the template's.
                child.files.write("/home/user/disk.txt", "the child's")
                reset = api.post(f"/sandboxes/{kid}/reset")
                assert reset.status_code == 200, reset.text
                _check_marks(child, pid)
            finally:
                assert api.delete(f"/sandboxes/{kid}").status_code == 204
            assert api.get(f"/sandboxes/{sbx.sandbox_id}").json()["state"] == "paused"
            assert api.post(f"/nodes/{NODES[1]}/cordon", json={}).status_code == 200
        back = Sandbox.connect(sbx.sandbox_id, timeout=600, request_timeout=RT)
        # Files, RAM and processes came with it, through object storage.
        assert _bound_node(server, sbx.sandbox_id, nodes) != NODES[1]
        _check_marks(back, pid)
    finally:
        _uncordon_all(server)
        Sandbox.kill(sbx.sandbox_id, request_timeout=RT)


def test_a_drained_node_loses_none_and_its_sandboxes_resume_elsewhere(
    cluster: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    server, nodes = cluster["server"], cluster["nodes"]
    _only_on(server, NODES[2])
    try:
        boxes = [_create(monkeypatch, server) for _ in range(2)]
    finally:
        _uncordon_all(server)
    try:
        pids = [_mark(b) for b in boxes]
        with _api(server) as api:
            resp = api.post(f"/nodes/{NODES[2]}/drain", timeout=600)
            assert resp.status_code == 200, resp.text
            body = resp.json()
            assert sorted(body["paused"]) == sorted(b.sandbox_id for b in boxes)
            assert body["failed"] == {} and body["node"]["state"] == "cordoned"
            for b in boxes:
                assert api.get(f"/sandboxes/{b.sandbox_id}").json()["state"] == "paused"
        for b, pid in zip(boxes, pids, strict=True):
            back = Sandbox.connect(b.sandbox_id, timeout=600, request_timeout=RT)
            assert _bound_node(server, b.sandbox_id, nodes) != NODES[2]
            _check_marks(back, pid)
    finally:
        _uncordon_all(server)
        for b in boxes:
            Sandbox.kill(b.sandbox_id, request_timeout=RT)


def test_a_snapshot_taken_on_one_node_is_created_from_on_another(
    cluster: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    server, nodes = cluster["server"], cluster["nodes"]
    _only_on(server, NODES[0])
    try:
        src = _create(monkeypatch, server)
    finally:
        _uncordon_all(server)
    child = None
    try:
        src.files.write("/home/user/made-on-a.txt", "from node a")
        snap = src.create_snapshot(request_timeout=RT)
        _only_on(server, NODES[2])
        try:
            child = Sandbox.create(snap.snapshot_id, timeout=600, request_timeout=RT)
        finally:
            _uncordon_all(server)
        assert _bound_node(server, child.sandbox_id, nodes) == NODES[2]
        assert child.files.read("/home/user/made-on-a.txt") == "from node a"
    finally:
        if child is not None:
            child.kill(request_timeout=RT)
        src.kill(request_timeout=RT)
    # Deleted through the other replica while node C (which pulled a copy) is down: gone
    # from node A's disk and the bucket at once, and from node C's when it comes back,
    # before it serves again (the delete's tombstone).
    node_c = nodes[2]
    assert (node_c.home / "snapshots" / snap.snapshot_id).exists()
    node_c.stop()
    r1 = cluster["servers"][1]
    for k, v in r1.sdk_env().items():
        monkeypatch.setenv(k, v)
    try:
        assert Sandbox.delete_snapshot(snap.snapshot_id, request_timeout=RT) is True
        assert (node_c.home / "snapshots" / snap.snapshot_id).exists(), "down: not asked"
    finally:
        node_c.start()
    _wait_ready(server, NODES)
    for node in nodes:
        assert not (node.home / "snapshots" / snap.snapshot_id).exists(), node.node_id
    assert Sandbox.delete_snapshot(snap.snapshot_id, request_timeout=RT) is False
    with pytest.raises(Exception, match=r"(?i)not found|404"):
        Sandbox.create(snap.snapshot_id, timeout=600, request_timeout=RT)


def test_a_template_built_through_one_replica_on_node_a_is_created_on_node_c(
    cluster: dict[str, Any], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The official SDK's `Template.build` through replica 1, its build sandbox on node A;
    the template, its tags, logs and step cache are the cluster's: replica 0 creates from
    it by name on node C, sees the build's status and logs, and an identical rebuild
    through replica 0 reuses the template snapshot replica 1 captured."""
    r0, r1 = cluster["servers"]
    (tmp_path / "hello.txt").write_text("copied through the bucket\n")
    template = (
        Template(file_context_path=tmp_path)
        .from_template("base")
        .copy("hello.txt", "/home/user/")
        .run_cmd("echo built-on-a > /home/user/made.txt")
        .set_start_cmd("python3 -m http.server 8000", wait_for_port(8000))
    )
    name = f"shared-{uuid.uuid4().hex[:6]}"
    for k, v in r1.sdk_env().items():
        monkeypatch.setenv(k, v)
    _only_on(r1, NODES[0])
    try:
        info = Template.build(template, name, cpu_count=1, memory_mb=512)
    finally:
        _uncordon_all(r1)
    for k, v in r0.sdk_env().items():
        monkeypatch.setenv(k, v)
    # Status and logs of a build replica 1 ran, through replica 0.
    with _api(r0) as api:
        status = api.get(f"/templates/{name}/builds/{info.build_id}/status").json()
        assert status["status"] == "ready", status
        assert any("built-on-a" in e["message"] or "made.txt" in e["message"]
                   for e in status["logEntries"]), status  # fmt: skip
        assert any(t["templateID"] == name for t in api.get("/templates").json())
        r = api.post("/templates/tags", json={"target": name, "tags": ["prod"]})
        assert r.status_code == 201, r.text
    _only_on(r0, NODES[2])
    try:
        sbx = Sandbox.create(f"{name}:prod", timeout=600, request_timeout=RT)
    finally:
        _uncordon_all(r0)
    try:
        assert _bound_node(r0, sbx.sandbox_id, cluster["nodes"]) == NODES[2]
        assert sbx.files.read("/home/user/hello.txt") == "copied through the bucket\n"
        assert sbx.files.read("/home/user/made.txt").strip() == "built-on-a"
        # The start command captured running in the template's memory serves on node C.
        out = sbx.commands.run("curl -sf -o /dev/null -w '%{http_code}' localhost:8000 || "
                               "python3 -c \"import urllib.request as u; "
                               "print(u.urlopen('http://localhost:8000').status)\"",
                               request_timeout=RT)  # fmt: skip
        assert out.stdout.strip().endswith("200"), out
    finally:
        sbx.kill(request_timeout=RT)
    # The same template again, through replica 0: replica 1's captured snapshot is reused.
    logs: list[str] = []
    again = Template.build(
        template, name, cpu_count=1, memory_mb=512, on_build_logs=lambda e: logs.append(e.message)
    )
    assert again.build_id != info.build_id
    assert any("reused from the cache" in line for line in logs), logs[-20:]
    # Deleted through replica 1: the template snapshot goes from every node that has it.
    assert _final_snapshots(cluster["nodes"]), "no node holds the template's snapshot"
    with _api(r1) as api:
        assert api.delete(f"/templates/{name}").status_code == 204
        assert api.get(f"/templates/{name}").status_code == 404
    assert _final_snapshots(cluster["nodes"]) == {}


def _final_snapshots(nodes: list[NodeProcess]) -> dict[str, list[str]]:
    """node id -> ids of the builder's template snapshots on its disk."""
    out: dict[str, list[str]] = {}
    for node in nodes:
        path = node.home / "snapshots" / "catalog.json"
        rows = json.loads(path.read_text())["snapshots"] if path.exists() else []
        ids = [r["id"] for r in rows
               if any(n.startswith("build-final-") for n in r.get("names", []))
               and (node.home / "snapshots" / r["id"]).exists()]  # fmt: skip
        if ids:
            out[node.node_id] = ids
    return out


def test_an_image_built_through_one_replica_is_imported_on_one_node_and_created_from(
    cluster: dict[str, Any], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """`fromImage` on a cluster: the image is pulled on one node (the replica has no layers),
    the build sandbox runs there, and replica 0 creates from the result on another node."""
    if not Path(REGISTRY_BIN).exists():
        pytest.fail("docker-registry is needed: scripts/test installs it")
    reg = Registry.start(tmp_path / "registry", tmp_path / "storage")
    try:
        pusher = Pusher(reg.url)
        try:
            push_busybox(pusher)
        finally:
            pusher.close()
        r0, r1 = cluster["servers"]
        for k, v in r1.sdk_env().items():
            monkeypatch.setenv(k, v)
        name = f"img-{uuid.uuid4().hex[:6]}"
        logs: list[str] = []
        template = (
            Template()
            .from_image(f"{reg.host}/busybox:1")
            .run_cmd("echo from-the-image > /tmp/marker; cp /tmp/marker /marker", user="root")
        )
        Template.build(template, name, cpu_count=1, memory_mb=512,
                       on_build_logs=lambda e: logs.append(e.message))  # fmt: skip
        assert any("pulled" in line for line in logs), logs[-20:]
        # The image template is in exactly one node's catalog.
        imported = [
            n.node_id
            for n in cluster["nodes"]
            if any(t.startswith("image-") for t in _catalog_names(n))
        ]
        assert len(imported) == 1, imported
        other = next(n for n in NODES if n != imported[0])
        for k, v in r0.sdk_env().items():
            monkeypatch.setenv(k, v)
        _only_on(r0, other)
        try:
            sbx = Sandbox.create(name, timeout=600, request_timeout=RT)
        finally:
            _uncordon_all(r0)
        try:
            assert _bound_node(r0, sbx.sandbox_id, cluster["nodes"]) == other
            assert sbx.files.read("/marker").strip() == "from-the-image"
        finally:
            sbx.kill(request_timeout=RT)
        with _api(r0) as api:
            assert api.delete(f"/templates/{name}").status_code == 204
        # Nothing else uses the image: it leaves the node's catalog, and the cluster's.
        for node in cluster["nodes"]:
            assert not [t for t in _catalog_names(node) if t.startswith("image-")], node.node_id
        with _api(r1) as api:
            listed = [t.get("templateID", "") for t in api.get("/templates").json()]
        assert not [t for t in listed if t.startswith("image-")], listed
    finally:
        reg.stop()


def _catalog_names(node: NodeProcess) -> list[str]:
    path = node.home / "templates.json"
    if not path.exists():
        return []
    raw = json.loads(path.read_text())
    rows = raw.get("templates", raw) if isinstance(raw, dict) else raw
    return [r["name"] for r in rows] if isinstance(rows, list) else list(rows)


def test_an_upload_link_one_replica_signs_the_other_accepts(cluster: dict[str, Any]) -> None:
    r0, r1 = cluster["servers"]
    name = f"up-{uuid.uuid4().hex[:6]}"
    with _api(r0) as a0, _api(r1) as a1:
        assert a0.post("/v3/templates", json={"name": name}).status_code == 202
        link = a0.get(f"/templates/{name}/files/abc123").json()
        assert link["present"] is False
        # The link names replica 0; replica 1 takes the upload.
        path = httpx.URL(link["url"]).raw_path.decode()
        put = httpx.put(f"{r1.url}{path}", content=b"archive", timeout=60, trust_env=False)
        assert put.status_code == 200, put.text
        assert a0.get(f"/templates/{name}/files/abc123").json() == {"present": True}
        bad = httpx.put(f"{r1.url}{path.replace('sig=', 'sig=0')}", content=b"x", timeout=60,
                        trust_env=False)  # fmt: skip
        assert bad.status_code == 403
        assert a1.delete(f"/templates/{name}").status_code == 204
        assert a0.get(f"/templates/{name}").status_code == 404


def test_every_sandbox_answers_through_either_replica_and_survives_one_dying(
    cluster: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    first, second = cluster["servers"]
    boxes = [_create(monkeypatch, first) for _ in range(2)]
    try:
        for k, v in second.sdk_env().items():
            monkeypatch.setenv(k, v)
        for b in boxes:
            via = Sandbox.connect(b.sandbox_id, timeout=600, request_timeout=RT)
            assert via.commands.run("hostname", request_timeout=RT).stdout.strip() == b.sandbox_id
        listed = {s.sandbox_id for s in Sandbox.list(limit=100, request_timeout=RT).next_items()}
        assert {b.sandbox_id for b in boxes} <= listed
        # The first replica dies: the second serves every sandbox, and creates.
        first.crash()
        for b in boxes:
            via = Sandbox.connect(b.sandbox_id, timeout=600, request_timeout=RT)
            assert via.commands.run("echo up", request_timeout=RT).stdout.strip() == "up"
        extra = Sandbox.create(template="base", timeout=600, request_timeout=RT)
        boxes.append(extra)
        assert extra.commands.run("echo new", request_timeout=RT).stdout.strip() == "new"
        # It comes back on the same store and sees them all.
        first.start()
        with _api(first) as api:
            ids = {r["sandboxID"] for r in api.get("/v2/sandboxes").json()}
        assert {b.sandbox_id for b in boxes} <= ids
    finally:
        for b in boxes:
            Sandbox.kill(b.sandbox_id, request_timeout=RT)


# A dead replica's lease lapses (AGENTENV_REPLICA_TTL_S=4), the row is seen orphaned for the
# grace (5 s), then settled at the next sweep (every 2 s): about 11 s, bounded here with room.
SETTLE_S = 45.0


def test_a_replica_killed_mid_pause_leaves_the_sandbox_to_another(
    cluster: dict[str, Any], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    first = cluster["servers"][0]
    home = prepare_home(tmp_path / "control-doomed")
    (home / "api-key").write_text(first.api_key)
    (home / "api-key").chmod(0o600)
    # This replica SIGKILLs itself once the row says pausing, before it asks the node.
    doomed = replica(home, {**cluster["env"], "AGENTENV_CRASH_AT": "control:pausing"}).start()
    sbx = _create(monkeypatch, first)
    try:
        pid = _mark(sbx)
        proc = doomed.proc
        assert proc is not None
        with _api(doomed) as api, pytest.raises(httpx.TransportError):
            api.post(f"/sandboxes/{sbx.sandbox_id}/pause")
        assert proc.wait(timeout=30) == -signal.SIGKILL
        crashed = time.monotonic()
        with _api(first) as api:
            # Meanwhile the row is the dead replica's: another pause is refused, not run.
            assert api.post(f"/sandboxes/{sbx.sandbox_id}/pause").status_code == 409
            while True:
                lines = [e["message"] for e in api.get(f"/v2/sandboxes/{sbx.sandbox_id}/logs")
                         .json()["logs"]]  # fmt: skip
                if any("was gone (was pausing)" in line for line in lines):
                    break
                assert time.monotonic() - crashed < SETTLE_S, f"not settled: {lines}"
                time.sleep(0.5)
            settled_s = time.monotonic() - crashed
            print(f"row of the dead replica settled {settled_s:.1f} s after the crash")
            # The node was never asked to pause: it is running again, where it was.
            state = api.get(f"/sandboxes/{sbx.sandbox_id}").json()["state"]
            assert state == "running", lines
        _check_marks(sbx, pid)
        # And every operation works on it again, through the live replicas.
        sbx.pause(request_timeout=RT)
        back = Sandbox.connect(sbx.sandbox_id, timeout=600, request_timeout=RT)
        _check_marks(back, pid)
    finally:
        doomed.crash()
        Sandbox.kill(sbx.sandbox_id, request_timeout=RT)


def test_operations_go_on_after_the_etcd_leader_is_killed(
    cluster: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    server, etcd = cluster["server"], cluster["etcd"]
    sbx = _create(monkeypatch, server)
    try:
        dead = etcd.kill_leader()
        try:
            # The next operations ride out the election (each etcd call retries the others).
            again = _create(monkeypatch, server)
            assert again.commands.run("echo ok", request_timeout=RT).stdout.strip() == "ok"
            again.kill(request_timeout=RT)
            sbx.pause(request_timeout=RT)
            back = Sandbox.connect(sbx.sandbox_id, timeout=600, request_timeout=RT)
            assert back.commands.run("echo back", request_timeout=RT).stdout.strip() == "back"
            assert sorted(_nodes(server)) == list(NODES)
        finally:
            etcd.restart(dead)
    finally:
        Sandbox.kill(sbx.sandbox_id, request_timeout=RT)


def test_a_killed_node_agent_loses_its_running_sandboxes_and_creates_go_on(
    cluster: dict[str, Any], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    server, nodes = cluster["server"], cluster["nodes"]
    victim = nodes[0]
    with _api(server) as api:
        for n in NODES[1:]:
            api.post(f"/nodes/{n}/cordon", json={"reason": "steer the next create"})
    try:
        doomed = _create(monkeypatch, server)
    finally:
        with _api(server) as api:
            for n in NODES[1:]:
                api.post(f"/nodes/{n}/uncordon")
    _only_on(server, victim.node_id)
    try:
        parked = _create(monkeypatch, server)
    finally:
        _uncordon_all(server)
    pid = _mark(parked)
    parked.pause(request_timeout=RT)
    assert _bound_node(server, doomed.sandbox_id, nodes) == victim.node_id
    victim.crash()
    # Its lease lapses; the control plane reports the sandbox lost, with the reason.
    deadline = time.monotonic() + LEASE_GONE_S
    with _api(server) as api:
        while True:
            resp = api.get(f"/sandboxes/{doomed.sandbox_id}")
            if resp.status_code == 404:
                break
            assert time.monotonic() < deadline, f"still {resp.json()} after the agent died"
            time.sleep(0.5)
        assert "lost" in resp.json()["message"] and victim.node_id in resp.json()["message"]
        assert victim.node_id not in _nodes(server)
    # Its paused sandbox resumes on another node, from object storage, memory and all.
    back = Sandbox.connect(parked.sandbox_id, timeout=600, request_timeout=RT)
    _check_marks(back, pid)
    moved_to = _bound_node(server, parked.sandbox_id, [n for n in nodes if n is not victim])
    assert moved_to != victim.node_id
    # Creates keep succeeding on the others.
    fresh = [_create(monkeypatch, server) for _ in range(2)]
    try:
        for b in fresh:
            assert _bound_node(server, b.sandbox_id, nodes) != victim.node_id
            assert b.commands.run("echo ok", request_timeout=RT).stdout.strip() == "ok"
    finally:
        for b in fresh:
            b.kill(request_timeout=RT)
    # The agent comes back: what it still held for the lost sandbox is deleted there, and its
    # old copy of the one that moved is dropped (the moved one keeps running elsewhere).
    victim.start()
    deadline = time.monotonic() + LEASE_GONE_S
    while any(
        (victim.home / "sandboxes" / s).exists() for s in (doomed.sandbox_id, parked.sandbox_id)
    ):
        assert time.monotonic() < deadline, "the returning node kept what is not its own"
        time.sleep(0.5)
    assert back.commands.run("echo still", request_timeout=RT).stdout.strip() == "still"
    back.kill(request_timeout=RT)


def test_an_agent_back_within_its_lease_keeps_its_sandboxes_and_reports_a_dead_one(
    cluster: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGKILL an agent and start it again (same id, same data dir) before its lease lapses:
    the cluster never sees it leave. Its running sandbox carries on (files, RAM, a process
    started before), and one whose QEMU was killed while the agent was down is reported lost
    (naming the node) once the agent is back, not left `running` until a call fails."""
    server, nodes = cluster["server"], cluster["nodes"]
    victim = nodes[1]
    # A lease that outlives the restart (the others' 4 s would lapse first).
    victim.stop()
    victim.env = {**victim.env, "AGENTENV_NODE_TTL_S": "60"}
    victim.start()
    _only_on(server, victim.node_id)
    try:
        keeper = _create(monkeypatch, server)
        doomed = _create(monkeypatch, server)
    finally:
        _uncordon_all(server)
    try:
        assert {_bound_node(server, b.sandbox_id, nodes) for b in (keeper, doomed)} == {
            victim.node_id
        }
        pid = _mark(keeper)
        record = victim.home / "run" / "vms" / f"{doomed.sandbox_id}.json"
        qemu = json.loads(record.read_text())["pid"]
        assert "qemu-system" in Path(f"/proc/{qemu}/cmdline").read_text(errors="replace")
        victim.crash()
        os.kill(qemu, signal.SIGKILL)  # that VM alone, while its agent is down
        victim.start()
        back_at = time.monotonic()
        # The dead one is reported lost with its node's name, without anyone calling it.
        with _api(server) as api:
            while True:
                resp = api.get(f"/sandboxes/{doomed.sandbox_id}")
                if resp.status_code == 404:
                    break
                assert time.monotonic() - back_at < LEASE_GONE_S, f"still {resp.json()}"
                time.sleep(0.5)
            message = resp.json()["message"]
            assert "lost" in message and victim.node_id in message, message
            assert api.get(f"/sandboxes/{keeper.sandbox_id}").json()["state"] == "running"
        _check_marks(keeper, pid)
        keeper.files.write("/home/user/after.txt", "after the restart")
        assert keeper.files.read("/home/user/after.txt") == "after the restart"
        for replica_server in cluster["servers"]:
            with _api(replica_server) as api:
                assert api.get(f"/sandboxes/{keeper.sandbox_id}").json()["state"] == "running"
    finally:
        Sandbox.kill(keeper.sandbox_id, request_timeout=RT)
        Sandbox.kill(doomed.sandbox_id, request_timeout=RT)
