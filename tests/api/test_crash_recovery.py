"""A server killed with SIGKILL, and VMs killed under a live server, as a user would see it.

The server runs as a child process with its data dir; the official SDK talks to it. After a
SIGKILL the QEMUs of running sandboxes keep running (their own session); the restarted
server must adopt them (same ids, tokens, files, processes), resume paused ones, finish or
undo the operation the crash cut short, and leave no process, namespace, slot, cgroup or file
of anything it did not keep. Crashes between two steps of an operation come from
`agentenv.faults` (`AGENTENV_CRASH_AT`): a random SIGKILL rarely lands inside a step that
takes milliseconds.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from e2b import Sandbox

from agentenv.api.devserver import ServerProcess
from agentenv.faults import POINTS
from agentenv.snapshot import SnapshotRepository
from agentenv.storage import LayerStore
from agentenv.template.datadir import prepare_home
from agentenv.vmm import cgroup
from agentenv.vmm import registry as vm_registry
from agentenv.vmm.registry import load_all

from .conftest import qemu_processes, stop_and_check

pytestmark = pytest.mark.vm

TIMEOUT_S = 600
# The suite runs without warm pools (tests/conftest.py); crash recovery is checked with the
# product's default pool, whose entries are VMs a crash leaves behind too.
WARM_POOL = {"AGENTENV_WARM_LOW": "1", "AGENTENV_WARM_HIGH": "2"}


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One data dir for the module, its template snapshot built (a capture, so a crash
    point in captures must not meet the template build)."""
    home = prepare_home(tmp_path_factory.mktemp("crash-home"))
    with ServerProcess(home, ready_timeout_s=240) as srv, _api(srv) as api:
        resp = api.post("/v2/sandboxes", json={"templateID": "base"})
        assert resp.status_code == 201, resp.text
        assert api.delete(f"/sandboxes/{resp.json()['sandboxID']}").status_code == 204
    return home


def _start(home: Path, port: int | None = None, **env: str) -> ServerProcess:
    srv = ServerProcess(home, port=port, env={**WARM_POOL, **env}, ready_timeout_s=240).start()
    os.environ.update(srv.sdk_env())
    return srv


@pytest.fixture
def restore_env() -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in ("E2B_API_URL", "E2B_SANDBOX_URL", "E2B_API_KEY")}
    yield
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def _api(srv: ServerProcess) -> httpx.Client:
    return httpx.Client(base_url=srv.url, headers={"X-API-Key": srv.api_key}, timeout=300)


def _runtime_id(sbx: Sandbox) -> str:
    """The node's name for the sandbox: the guest's hostname."""
    return sbx.commands.run("hostname").stdout.strip()


def _record(home: Path, runtime_id: str) -> Any:
    found = [r for r in load_all(home / "run" / "vms") if r.name == runtime_id]
    assert found, f"no VM record for {runtime_id}"
    return found[0]


def _leftovers(home: Path) -> dict[str, list[str]]:
    """What a stopped server must not leave in its data dir (after all sandboxes went)."""
    out = {
        "qemu": qemu_processes(home, warm=True, converters=True),
        "vm records": [r.name for r in load_all(home / "run" / "vms")],
        "slot markers": sorted(p.name for p in (home / "run" / "slots").glob("*")),
        "sandbox dirs": sorted(p.name for p in (home / "sandboxes").glob("*")),
        "build dirs": sorted(p.name for p in (home / "snapshots").glob(".build-tpl-*")),
        "netns": [
            n
            for n in (os.listdir("/run/netns") if os.path.isdir("/run/netns") else [])
            if n in {p.name for p in (home / "run" / "slots").glob("*")}
        ],
    }
    return {k: v for k, v in out.items() if v}


def _finish(srv: ServerProcess) -> None:
    stop_and_check(srv)
    assert not _leftovers(srv.home), _leftovers(srv.home)


def _await_crash(srv: ServerProcess, timeout_s: float = 120) -> None:
    """The server killed itself at its crash point."""
    assert srv.proc is not None
    srv.proc.wait(timeout=timeout_s)
    assert srv.proc.returncode == -signal.SIGKILL, srv.log_tail()
    srv.proc = None


def test_sigkill_while_running_keeps_sandboxes(home: Path, restore_env: None) -> None:
    srv = _start(home)
    try:
        running = Sandbox.create(timeout=TIMEOUT_S, metadata={"who": "running"})
        running.files.write("/home/user/note.txt", "kept")
        sleeper = running.commands.run("sleep 1000", background=True)
        paused = Sandbox.create(timeout=TIMEOUT_S, metadata={"who": "paused"})
        paused.files.write("/home/user/p.txt", "paused file")
        paused.beta_pause()
        with _api(srv) as api:
            before = {s["sandboxID"]: s for s in api.get("/v2/sandboxes").json()}
        rid = _runtime_id(running)
        pid = _record(home, rid).pid
        srv.crash()
        # The VM outlives the server: that is what makes adoption possible.
        os.kill(pid, 0)
        srv = _start(home, srv.port)
        with _api(srv) as api:
            after = {s["sandboxID"]: s for s in api.get("/v2/sandboxes").json()}
        for sid in (running.sandbox_id, paused.sandbox_id):
            for key in ("metadata", "endAt", "envdAccessToken", "state"):
                assert after[sid].get(key) == before[sid].get(key), (sid, key)
        again = Sandbox.connect(running.sandbox_id)
        assert again.files.read("/home/user/note.txt") == "kept"
        procs = [p.pid for p in again.commands.list()]
        assert sleeper.pid in procs
        assert _record(home, rid).pid == pid, "the same QEMU runs on"
        # The command started before the crash is still the guest's: reconnect and end it.
        assert again.commands.kill(sleeper.pid)
        back = Sandbox.connect(paused.sandbox_id)
        assert back.files.read("/home/user/p.txt") == "paused file"
        again.kill()
        back.kill()
    finally:
        _finish(srv)


def test_vm_killed_is_noticed_and_freed(home: Path, restore_env: None) -> None:
    srv = _start(home)
    try:
        sbx = Sandbox.create(timeout=TIMEOUT_S)
        rid = _runtime_id(sbx)
        rec = _record(home, rid)
        killed_at = time.time()
        os.kill(rec.pid, signal.SIGKILL)
        with _api(srv) as api:
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                resp = api.get(f"/sandboxes/{sbx.sandbox_id}")
                if resp.status_code == 404:
                    break
                time.sleep(0.05)
            assert resp.status_code == 404, resp.text
            assert "was lost" in resp.json()["message"], resp.text
            logs = api.get(f"/sandboxes/{sbx.sandbox_id}/logs").json()["logs"]
            lost = [line for line in logs if "lost: " in line["line"]]
            assert lost, logs
            noticed = datetime_ts(lost[-1]["timestamp"])
            print(f"VM death noticed {noticed - killed_at:.3f}s after the kill")
            assert noticed - killed_at < 1.0
            proxied = httpx.get(
                f"{srv.url}/health",
                headers={"E2B-Sandbox-Id": sbx.sandbox_id, "E2B-Sandbox-Port": "49983"},
            )
            assert proxied.status_code == 502
            assert proxied.json()["code"] == 502

        # The record goes first (404 above); its files, VM record and cgroup follow in the
        # teardown, which a loaded host may still be running.
        def held() -> list[str]:
            return [
                what
                for what, still in (
                    ("workdir", (home / "sandboxes" / rid).exists()),
                    ("vm record", rid in {r.name for r in load_all(home / "run" / "vms")}),
                    ("cgroup", any(p.name == rid for p in cgroup.stale())),
                )
                if still
            ]

        deadline = time.monotonic() + 30
        while held() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not held(), srv.log_tail(30)
        # The next create still works.
        nxt = Sandbox.create(timeout=TIMEOUT_S)
        assert nxt.commands.run("echo ok").stdout.strip() == "ok"
        nxt.kill()
    finally:
        _finish(srv)


def test_dead_warm_entry_is_replaced_not_handed_out(home: Path, restore_env: None) -> None:
    srv = _start(home)
    try:
        Sandbox.create(timeout=TIMEOUT_S).kill()  # the shape joins the warm pool
        warm_dir = str(home / "warm")

        def warm_records() -> list[Any]:
            return [r for r in load_all(home / "run" / "vms") if r.workdir.startswith(warm_dir)]

        deadline = time.monotonic() + 120
        while not warm_records() and time.monotonic() < deadline:
            time.sleep(0.2)
        victims = warm_records()
        assert victims, "the warm pool never filled"
        for r in victims:
            os.kill(r.pid, signal.SIGKILL)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            names = {r.name for r in load_all(home / "run" / "vms")}
            if not names & {r.name for r in victims}:
                break
            time.sleep(0.05)
        assert not names & {r.name for r in victims}, "dead warm entries were not dropped"
        sbx = Sandbox.create(timeout=TIMEOUT_S)
        assert _runtime_id(sbx) not in {r.name for r in victims}
        assert sbx.commands.run("echo ok").stdout.strip() == "ok"
        sbx.kill()
    finally:
        _finish(srv)


def test_sigkill_keeps_a_sandbox_made_from_a_warm_entry(home: Path, restore_env: None) -> None:
    """A warm entry's workdir moves into the sandboxes dir when a create takes it, while its
    QEMU runs on with the socket path it was started with: the next server must still
    recognise that QEMU as the sandbox's, adopt it, and leave nothing running."""
    srv = _start(home)
    try:
        Sandbox.create(timeout=TIMEOUT_S).kill()  # the shape joins the warm pool
        warm_dir = str(home / "warm")

        def warm_pids() -> set[int]:
            return {
                r.pid
                for r in load_all(home / "run" / "vms")
                if r.workdir.startswith(warm_dir) and r.pid is not None
            }

        deadline = time.monotonic() + 120
        while not warm_pids() and time.monotonic() < deadline:
            time.sleep(0.2)
        ready = warm_pids()
        assert ready, "the warm pool never filled"
        time.sleep(2)  # its QMP connected: the entry is ready, not only spawned
        sbx = Sandbox.create(timeout=TIMEOUT_S)
        rid = _runtime_id(sbx)
        # One id: the entry's QEMU runs on under the sandbox's id, renamed when taken.
        assert rid == sbx.sandbox_id
        assert _record(home, rid).pid in ready, "the create did not take a warm entry"
        sbx.files.write("/home/user/w.txt", "warm")
        pid = _record(home, rid).pid
        srv.crash()
        srv = _start(home, srv.port)
        again = Sandbox.connect(sbx.sandbox_id)
        assert again.files.read("/home/user/w.txt") == "warm"
        assert _record(home, rid).pid == pid, "the same QEMU runs on"
        again.kill()
    finally:
        _finish(srv)


@pytest.mark.parametrize("point", ["create:relocated", "create:restored"])
def test_sigkill_mid_create_leaves_nothing(home: Path, restore_env: None, point: str) -> None:
    """A create cut short (from a warm entry, or restored but not yet told to the control
    plane) ends as if it never happened: no sandbox listed, no QEMU, slot or files left,
    and the next create works."""
    assert point in POINTS
    srv = _start(home, AGENTENV_CRASH_AT=point)
    try:
        with _api(srv) as api:
            if point == "create:relocated":
                first = api.post("/v2/sandboxes", json={"templateID": "base"})
                assert first.status_code == 201, first.text  # the shape joins the warm pool
                assert api.delete(f"/sandboxes/{first.json()['sandboxID']}").is_success
                warm_dir = str(home / "warm")
                deadline = time.monotonic() + 120
                while time.monotonic() < deadline and not [
                    r
                    for r in load_all(home / "run" / "vms")
                    if r.workdir.startswith(warm_dir) and r.pid is not None
                ]:
                    time.sleep(0.2)
                time.sleep(2)
            with pytest.raises(httpx.TransportError):
                api.post("/v2/sandboxes", json={"templateID": "base"})
        _await_crash(srv)
        srv = _start(home, srv.port)
        with _api(srv) as api:
            assert api.get("/v2/sandboxes").json() == []
            # Its warm pool fills only for shapes created from, so nothing at all runs.
            assert not qemu_processes(home, warm=True, converters=True)
            resp = api.post("/v2/sandboxes", json={"templateID": "base"})
            assert resp.status_code == 201, resp.text
            assert api.delete(f"/sandboxes/{resp.json()['sandboxID']}").is_success
    finally:
        _finish(srv)


def _held(home: Path, sandbox_id: str) -> list[str]:
    """What of a sandbox's cleanup stack is still there: its workdir (upper, records), layer
    and snapshot references, VM record, cgroup and QEMU (its jail lives in the QEMU's own
    mount namespace and goes with it); its slot's egress rules: `_rule_holders`."""
    layers = LayerStore(home / "layers")
    repo = SnapshotRepository(home / "snapshots", layers)
    return [
        what
        for what, still in (
            ("workdir", (home / "sandboxes" / sandbox_id).exists()),
            ("upper", (home / "sandboxes" / sandbox_id / "rootfs.qcow2").exists()),
            ("layer ref", sandbox_id in layers.all_holders()),
            ("snapshot ref", sandbox_id in repo.all_holders()),
            ("vm record", sandbox_id in {r.name for r in load_all(home / "run" / "vms")}),
            ("cgroup", any(p.name == sandbox_id for p in cgroup.stale())),
            (
                "qemu",
                any(
                    f"/{sandbox_id}/" in cmd and "/convert/" not in cmd
                    for cmd in vm_registry.qemu_processes(str(home)).values()
                ),
            ),
        )
        if still
    ]


def _rule_holders(home: Path, target: str) -> list[str]:
    """This server's slot namespaces whose egress table names `target` (a sandbox's own
    deny rule, so its slot's nft rules can be told apart from every other's)."""
    found = []
    for marker in sorted((home / "run" / "slots").glob("*")):
        out = subprocess.run(
            ["ip", "netns", "exec", marker.name, "nft", "list", "ruleset"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        if target in out.stdout:
            found.append(marker.name)
    return found


# Each crash point of a sandbox's stack: the request that reaches it (on the victim, made by
# `_victim`), and whether the victim is kept (paused, its workdir and references held) or
# gone once the restarted server is up. A fork's children are always gone, its source kept.
STACK_POINTS = {
    "delete:vm-gone": ("delete", "gone"),  # QEMU gone; slot, references, workdir held
    "pause:recorded": ("pause", "paused"),  # paused record written, QEMU still alive
    "resume:loaded": ("resume", "paused"),  # a new QEMU and slot hold its state
    "fork:child": ("fork", "running"),  # one child restored, the others partly made
    # Last: a server with a create point dies on every create, the neighbour's too.
    "create:acquired": ("create", "gone"),  # workdir, references, slot; no QEMU
    "create:loaded": ("create", "gone"),  # + its restored QEMU (adopted, deleted as unknown)
}


def _victim(api: httpx.Client, op: str, deny: str) -> str | None:
    """Start the victim as far as `op` needs, then send the request that crashes the
    server; the victim's id (None for a create, whose id the crash kept from us)."""
    body = {"templateID": "base", "network": {"denyOut": [deny]}}
    if op == "create":
        with pytest.raises(httpx.TransportError):
            api.post("/v2/sandboxes", json=body)
        return None
    resp = api.post("/v2/sandboxes", json=body)
    assert resp.status_code == 201, resp.text
    sid = str(resp.json()["sandboxID"])
    if op == "resume":
        assert api.post(f"/sandboxes/{sid}/pause").status_code == 204
    with pytest.raises(httpx.TransportError):
        if op == "delete":
            api.delete(f"/sandboxes/{sid}")
        else:
            api.post(f"/sandboxes/{sid}/{op}", json={"count": 2} if op == "fork" else {})
    return sid


def test_sigkill_at_each_crash_point_frees_its_stack(home: Path, restore_env: None) -> None:
    """A SIGKILL at each crash point of a sandbox's stack (create, delete, pause, resume,
    fork), one server start per point: the server that recovers from one crash is the next
    one to crash, so a neighbour sandbox made at the start lives through every restart.
    After each restart everything the cut-short operation's stack had recorded (workdir,
    upper, layer and snapshot references, QEMU, VM record, cgroup, its slot's egress rules)
    is gone, and nothing else is: a paused victim keeps its files and references, a fork's
    source runs on, the neighbour keeps its QEMU, cgroup, record and rules."""
    points = list(STACK_POINTS)
    assert set(points) <= POINTS
    # No warm pool: a create starts filling it, and an entry's QEMU spawning at the moment
    # of the SIGKILL is a race of the warm pool's, not a part of the create's stack.
    cold = {"AGENTENV_WARM_LOW": "0", "AGENTENV_WARM_HIGH": "0"}
    srv = _start(home, AGENTENV_CRASH_AT=points[0], **cold)
    try:
        with _api(srv) as api:
            resp = api.post(
                "/v2/sandboxes",
                json={"templateID": "base", "network": {"denyOut": ["198.51.100.7"]}},
            )
            assert resp.status_code == 201, resp.text
        neighbour = resp.json()["sandboxID"]
        npid = _record(home, neighbour).pid
        nslots = _rule_holders(home, "198.51.100.7")
        assert len(nslots) == 1, nslots
        for i, point in enumerate(points):
            op, outcome = STACK_POINTS[point]
            deny = f"192.0.2.{i + 1}"
            before = {p.name for p in (home / "sandboxes").iterdir()}
            with _api(srv) as api:
                victim = _victim(api, op, deny)
            _await_crash(srv)
            new = sorted({p.name for p in (home / "sandboxes").iterdir()} - before)
            if victim is None:
                assert len(new) == 1, (point, new)
                victim = new[0]
            # A fork's children go; a paused victim stays.
            gone = [victim] if outcome == "gone" else [n for n in new if n != victim]
            assert gone or outcome == "paused", point
            # What the stacks had recorded when the server died.
            recorded = {sid: _held(home, sid) for sid in gone or [victim]}
            assert all("workdir" in r for r in recorded.values()), (point, recorded)
            assert any("layer ref" in r for r in recorded.values()), (point, recorded)
            if point in ("create:loaded", "fork:child", "pause:recorded", "resume:loaded"):
                assert any("vm record" in r for r in recorded.values()), (point, recorded)
            if outcome != "running":
                assert _rule_holders(home, deny), (point, "no slot holds the victim's rules")
            nxt = {"AGENTENV_CRASH_AT": points[i + 1]} if i + 1 < len(points) else {}
            srv = _start(home, srv.port, **cold, **nxt)
            for sid in gone:
                assert not _held(home, sid), (point, sid, _held(home, sid))
            with _api(srv) as api:
                listed = {s["sandboxID"]: s["state"] for s in api.get("/v2/sandboxes").json()}
                if outcome == "gone":
                    assert victim not in listed, (point, listed)
                    assert not _rule_holders(home, deny), point
                elif outcome == "paused":
                    assert listed.get(victim) == "paused", (point, listed)
                    held = set(_held(home, victim))
                    assert {"workdir", "upper", "layer ref"} <= held, (point, held)
                    assert not {"vm record", "cgroup", "qemu"} & held, (point, held)
                    assert not _rule_holders(home, deny), point
                else:
                    assert listed.get(victim) == "running", (point, listed)
                    assert not set(gone) & set(listed), (point, listed)
                    # The children's slots went; the source's rules stay on its own.
                    assert len(_rule_holders(home, deny)) == 1, point
                # Nothing else was released: the neighbour's QEMU, cgroup, record and rules.
                assert listed.get(neighbour) == "running", (point, listed)
                assert _record(home, neighbour).pid == npid, point
                assert {"vm record", "cgroup", "qemu"} <= set(_held(home, neighbour)), point
                assert _rule_holders(home, "198.51.100.7") == nslots, point
                if outcome != "gone":
                    assert api.delete(f"/sandboxes/{victim}").is_success, point
                    assert not _held(home, victim), (point, _held(home, victim))
        with _api(srv) as api:
            resp = api.post("/v2/sandboxes", json={"templateID": "base"})
            assert resp.status_code == 201, resp.text
            assert api.delete(f"/sandboxes/{resp.json()['sandboxID']}").is_success
            assert api.delete(f"/sandboxes/{neighbour}").is_success
    finally:
        _finish(srv)


def test_killed_converter_keeps_the_paused_sandbox(home: Path, restore_env: None) -> None:
    """The helper QEMU that converts a paused RAM stream dies: the stream is kept and the
    sandbox resumes from it."""
    srv = _start(home)
    try:
        sbx = Sandbox.create(timeout=TIMEOUT_S)
        sbx.files.write("/home/user/c.txt", "converted or not")
        rid = _runtime_id(sbx)
        sbx.beta_pause()
        killed = None
        deadline = time.monotonic() + 60
        while killed is None and time.monotonic() < deadline:
            for r in load_all(home / "run" / "vms"):
                if r.name == f"{rid}-cv" and r.pid is not None:
                    os.kill(r.pid, signal.SIGKILL)
                    killed = r.pid
            time.sleep(0.01)
        assert killed is not None, "no converter ran"
        back = Sandbox.connect(sbx.sandbox_id)
        assert back.files.read("/home/user/c.txt") == "converted or not"
        back.kill()
    finally:
        _finish(srv)


def datetime_ts(text: str) -> float:
    from datetime import datetime

    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


# Where each operation ends up after a crash at that point, as the restarted server finds it,
# in the order the chain below runs them. `pause:recorded` and `resume:loaded` (both end
# paused) are checked by `test_sigkill_at_each_crash_point_frees_its_stack`, which also checks
# what each frees.
#
# The server that recovers from one case's crash checks that case, then runs the next case up
# to its crash point. So what a case's check does must not pass the next case's point: the
# check resumes the sandbox if it is paused (a memory pause resumes through `resume:*`, a
# filesystem one through `coldboot:*`), and then repeats the operation: a fork (`capture:*`,
# `fork:*`), a capture, or else a pause and a resume (`pause:*`, `resume:*`).
CRASH_CASES = {
    # Forked while paused (#24): the parent stays paused whatever the children got to.
    "fork:child": "paused",
    "pause:saved": "running",
    "coldboot:running": "running",
    "fspause:stopped": "running",
    "coldboot:booting": "paused",
    "fspause:recorded": "paused",
    "capture:sealed": "running",
    "fork:captured": "running",
    "resume:running": "running",
}
# Crash points whose restarted server must find a filesystem-only pause: no RAM kept.
FILESYSTEM_PAUSED = {"fspause:recorded", "coldboot:booting"}


def _crash_mid(srv: ServerProcess, point: str) -> tuple[Sandbox, str]:
    """A sandbox made on `srv` (armed at `point`), taken to the operation the point is in;
    the request for that operation kills the server. The sandbox and its runtime id."""
    sbx = Sandbox.create(timeout=TIMEOUT_S)
    sbx.files.write("/home/user/f.txt", point)
    rid = _runtime_id(sbx)
    op = point.split(":")[0]
    body: dict[str, Any] = {"count": 2} if op == "fork" else {}
    if op == "resume" or point == "fork:child":
        sbx.beta_pause()
    elif point == "coldboot:booting":
        # A memory pause resumed without its memory: the record turns into a disk one
        # before the boot. The file is synced (an unsynced write may be lost, as E2B).
        sbx.commands.run("sync")
        sbx.beta_pause()
        body = {"memory": False}
    elif op == "coldboot":
        sbx.pause(mode="filesystem")
    elif op == "fspause":
        body = {"memory": False}
    path = {
        "pause": "pause",
        "fspause": "pause",
        "resume": "resume",
        "coldboot": "resume",
        "capture": "snapshots",
        "fork": "fork",
    }[op]
    with _api(srv) as api, pytest.raises(httpx.TransportError):
        api.post(f"/sandboxes/{sbx.sandbox_id}/{path}", json=body)
    _await_crash(srv)
    return sbx, rid


def _check_recovered(srv: ServerProcess, point: str, sbx: Sandbox, rid: str) -> None:
    """The restarted server found the operation cut short at `point` rolled forward or back,
    the sandbox's files intact, and the operation works again."""
    home = srv.home
    op = point.split(":")[0]
    if op == "fork":
        # The cut-short fork's hold on its capture went with the restart.
        held = SnapshotRepository(home / "snapshots", LayerStore(home / "layers")).all_holders()
        assert not [h for h in held if h.startswith("fork")], (point, held)
    with _api(srv) as api:
        resp = api.get(f"/sandboxes/{sbx.sandbox_id}")
        assert resp.status_code == 200, (point, resp.text, srv.log_tail(30))
        assert resp.json()["state"] == CRASH_CASES[point], (point, resp.text)
        if point in FILESYSTEM_PAUSED:
            assert resp.json()["pauseMode"] == "filesystem", (point, resp.text)
            workdir = home / "sandboxes" / rid
            assert json.loads((workdir / "paused.json").read_text())["kind"] == "disk", point
            assert not (workdir / "memory").exists(), (point, "the dropped RAM is still on disk")
        listed = api.get("/v2/sandboxes").json()
        assert [s["sandboxID"] for s in listed] == [sbx.sandbox_id], (point, "children remain")
    again = Sandbox.connect(sbx.sandbox_id)
    assert again.files.read("/home/user/f.txt") == point
    again.files.write("/home/user/g.txt", "after")
    assert again.commands.run("cat /home/user/g.txt").stdout == "after"
    # The operation works now.
    with _api(srv) as api:
        if op == "fork":
            resp = api.post(f"/sandboxes/{sbx.sandbox_id}/fork", json={"count": 1})
            assert resp.status_code == 201, (point, resp.text)
            for child in resp.json():
                assert api.delete(f"/sandboxes/{child['sandbox']['sandboxID']}").is_success
        elif op == "capture":
            resp = api.post(f"/sandboxes/{sbx.sandbox_id}/snapshots", json={})
            assert resp.status_code == 201, (point, resp.text)
        else:
            again.beta_pause()
            assert Sandbox.connect(sbx.sandbox_id).files.read("/home/user/g.txt") == "after"
    again.kill()


def _log_size(srv: ServerProcess) -> int:
    return srv.log_path.stat().st_size if srv.log_path.exists() else 0


def _errors_logged(srv: ServerProcess, since: int) -> list[str]:
    with srv.log_path.open("rb") as log:
        log.seek(since)
        text = log.read().decode(errors="replace")
    return [line for line in text.splitlines() if "Traceback" in line or " ERROR agentenv" in line]


def test_sigkill_mid_operation_rolls_forward_or_back(home: Path, restore_env: None) -> None:
    """A SIGKILL at each point of `CRASH_CASES`, one server start per case: the server that
    recovers from one case's crash checks it (state, files, the operation once more, no error
    logged) and is the next case's to crash."""
    points = list(CRASH_CASES)
    assert set(points) <= POINTS
    srv = _start(home, AGENTENV_CRASH_AT=points[0])
    try:
        for i, point in enumerate(points):
            sbx, rid = _crash_mid(srv, point)
            nxt = {"AGENTENV_CRASH_AT": points[i + 1]} if i + 1 < len(points) else {}
            since = _log_size(srv)
            srv = _start(home, srv.port, **nxt)
            _check_recovered(srv, point, sbx, rid)
            assert not _errors_logged(srv, since), (point, _errors_logged(srv, since))
    finally:
        _finish(srv)


def test_sigkill_during_template_build(tmp_path: Path, restore_env: None) -> None:
    fresh = prepare_home(tmp_path / "fresh", seeded=False)  # the build is what crashes
    srv = _start(fresh, AGENTENV_CRASH_AT="template:booted")
    try:
        with pytest.raises(Exception):  # noqa: B017 - the server dies under the request
            Sandbox.create(timeout=TIMEOUT_S, request_timeout=300)
        _await_crash(srv, 300)
        # The build VM was left running: the next server must end it.
        assert qemu_processes(fresh, warm=True, converters=True)
        srv = _start(fresh, srv.port)
        assert not list((fresh / "snapshots").glob(".build-tpl-*"))
        assert not qemu_processes(fresh, warm=True, converters=True)
        sbx = Sandbox.create(timeout=TIMEOUT_S, request_timeout=300)
        assert sbx.commands.run("echo built").stdout.strip() == "built"
        sbx.kill()
    finally:
        _finish(srv)


def test_sigkill_mid_reset_finishes_it(home: Path, restore_env: None) -> None:
    """A server killed between a reset's delete of the old guest and the start of the saved
    state (#24): the next server finishes the reset. The sandbox runs again under the same id,
    token and deadline, at its template's state (the episode's file gone), and after its kill
    nothing of it is left."""
    srv = _start(home, AGENTENV_CRASH_AT="reset:deleted")
    try:
        sbx = Sandbox.create(timeout=TIMEOUT_S, metadata={"episode": "7"})
        sbx.files.write("/home/user/episode.txt", "step-1")
        with _api(srv) as api:
            before = next(s for s in api.get("/v2/sandboxes").json())
            with pytest.raises(httpx.TransportError):
                api.post(f"/sandboxes/{sbx.sandbox_id}/reset")
        _await_crash(srv)
        srv = _start(home, srv.port)
        with _api(srv) as api:
            (after,) = api.get("/v2/sandboxes").json()
            assert after["sandboxID"] == sbx.sandbox_id
            assert after["state"] == "running"
            assert after["endAt"] == before["endAt"]
            assert after["metadata"] == {"episode": "7"}
            assert "finished" in api.get(f"/sandboxes/{sbx.sandbox_id}/logs").text
        # The SDK object made before the crash (its token) reaches the reset guest.
        assert not sbx.files.exists("/home/user/episode.txt")
        assert sbx.commands.run("echo ok").stdout.strip() == "ok"
        sbx.kill()
        assert _held(home, sbx.sandbox_id) == []
    finally:
        _finish(srv)


def test_sigkill_mid_reset_of_a_fork_child_keeps_its_capture(home: Path, restore_env: None) -> None:
    """A fork's child whose parent is gone is the only holder of the fork's capture. A server
    killed mid-reset of it (the old guest gone, its stack run by the restart) must not lose
    the capture: the restart finishes the reset from it, and the child's kill then lets it go."""
    srv = _start(home, AGENTENV_CRASH_AT="reset:deleted")
    repo = SnapshotRepository(home / "snapshots", LayerStore(home / "layers"))
    try:
        parent = Sandbox.create(timeout=TIMEOUT_S)
        parent.files.write("/home/user/state.txt", "forked")
        with _api(srv) as api:
            resp = api.post(f"/sandboxes/{parent.sandbox_id}/fork", json={"count": 1})
            assert resp.status_code == 201, resp.text
            child_id = resp.json()[0]["sandbox"]["sandboxID"]
            parent.kill()
            child = Sandbox.connect(child_id)
            child.files.write("/home/user/state.txt", "episode")
            rid = _runtime_id(child)
            (capture,) = [s.id for s in repo.list() if rid in s.holders]
            with pytest.raises(httpx.TransportError):
                api.post(f"/sandboxes/{child_id}/reset")
        _await_crash(srv)
        srv = _start(home, srv.port)
        with _api(srv) as api:
            resp = api.get(f"/sandboxes/{child_id}")
            assert resp.status_code == 200, (resp.text, srv.log_tail(30))
            assert resp.json()["state"] == "running", resp.text
        assert Sandbox.connect(child_id).files.read("/home/user/state.txt") == "forked"
        assert not [h for h in repo.all_holders() if h.startswith("reset:")]
        Sandbox.connect(child_id).kill()
        assert _held(home, rid) == []
        assert capture not in {s.id for s in repo.list()}, "the capture outlived its last child"
    finally:
        _finish(srv)


def test_lost_sandbox_error_names_it(home: Path, restore_env: None) -> None:
    """A running sandbox whose VM died while no server ran is reported lost, not missing."""
    srv = _start(home)
    try:
        sbx = Sandbox.create(timeout=TIMEOUT_S)
        pid = _record(home, _runtime_id(sbx)).pid
        srv.crash()
        os.kill(pid, signal.SIGKILL)
        srv = _start(home, srv.port)
        with _api(srv) as api:
            resp = api.get(f"/sandboxes/{sbx.sandbox_id}")
            assert resp.status_code == 404
            assert f"sandbox {sbx.sandbox_id} was lost" in resp.json()["message"]
            connect = api.post(f"/sandboxes/{sbx.sandbox_id}/connect", json={"timeout": 60})
            assert connect.status_code == 404
            assert "was lost" in connect.json()["message"]
            assert json.dumps(api.get("/v2/sandboxes").json()).count(sbx.sandbox_id) == 0
    finally:
        _finish(srv)
