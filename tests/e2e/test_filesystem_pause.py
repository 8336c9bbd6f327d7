"""Filesystem-only pause, resume and snapshot (E2B's `memory: false`) through the official SDK
against a live server on real microVMs: files are kept, processes are not (the guest boots
again), the sandbox keeps its id, token, env vars, metadata and egress policy; an auto-pause
with `mode: "filesystem"` is such a pause; a filesystem-only snapshot's creates boot from
its disk. Timings of both kinds of pause and resume are printed (`-s`)."""

from __future__ import annotations

import contextlib
import json
import subprocess
import time
from collections.abc import Callable
from typing import TypeVar

import httpx
import pytest
from api.conftest import REQUEST_TIMEOUT_S
from e2b import Sandbox, SandboxQuery, SandboxState

from agentenv.api.devserver import ServerProcess
from agentenv.network.nft import EGRESS_TABLE
from agentenv.vmm.registry import load_all

pytestmark = pytest.mark.vm

# A process nothing else in the guest runs: `pgrep` finds it by its argument.
SLEEPER = "sleep 4321"
RT = REQUEST_TIMEOUT_S
FIND_SLEEPER = "pgrep -f 'sleep 432[1]' || true"
BOOT_ID = "cat /proc/sys/kernel/random/boot_id"


@pytest.fixture(autouse=True)
def sdk_env(server: ServerProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    """The SDK finds the server through its environment (as a user would set it up)."""
    for key, value in server.sdk_env().items():
        monkeypatch.setenv(key, value)


def runtime_id(sbx: Sandbox) -> str:
    """The node's name for the sandbox (its workdir, its VM): the guest's hostname."""
    return sbx.commands.run("hostname").stdout.strip()


def detail(api: httpx.Client, sandbox_id: str) -> dict[str, object]:
    resp = api.get(f"/sandboxes/{sandbox_id}")
    assert resp.status_code == 200, resp.text
    body: dict[str, object] = resp.json()
    return body


def paused_kind(srv: ServerProcess, rid: str) -> str:
    record = json.loads((srv.home / "sandboxes" / rid / "paused.json").read_text())
    kind: str = record["kind"]
    return kind


def egress_table_in_slot(srv: ServerProcess, rid: str) -> bool:
    """Whether the slot the sandbox's VM runs in has its egress table."""
    recs = [r for r in load_all(srv.home / "run" / "vms") if r.name == rid]
    assert recs, f"no VM record for {rid}"
    netns = recs[0].spec["netns"]
    res = subprocess.run(
        ["ip", "netns", "exec", netns, "nft", "list", "table", "inet", EGRESS_TABLE],
        capture_output=True,
        timeout=30,
    )
    return res.returncode == 0


T = TypeVar("T")


def timed(what: str, timings: dict[str, float], fn: Callable[[], T]) -> T:
    t0 = time.monotonic()
    out = fn()
    timings[what] = round(time.monotonic() - t0, 3)
    return out


def test_filesystem_pause_keeps_files_and_drops_processes(
    server: ServerProcess, api: httpx.Client
) -> None:
    sbx = Sandbox.create(
        template="base",
        timeout=600,
        envs={"FOO": "from-create"},
        metadata={"who": "fs"},
        allow_internet_access=False,
        lifecycle={"on_timeout": "pause", "auto_resume": True},
        request_timeout=RT,
    )
    sid = sbx.sandbox_id
    timings: dict[str, float] = {}
    try:
        rid = runtime_id(sbx)
        workdir = server.home / "sandboxes" / rid
        token = detail(api, sid)["envdAccessToken"]
        sbx.files.write("/home/user/kept.txt", "on disk")
        sbx.commands.run(SLEEPER, background=True, timeout=0)
        boot_id = sbx.commands.run(BOOT_ID).stdout.strip()

        # A memory pause first, to compare: the process and the boot survive it.
        assert timed("memory pause", timings, sbx.pause) is True
        assert detail(api, sid)["pauseMode"] == "full"
        again = timed("memory resume", timings, lambda: Sandbox.connect(sid, request_timeout=RT))
        assert isinstance(again, Sandbox)
        assert again.commands.run(FIND_SLEEPER).stdout.strip(), "a memory resume kept it"
        assert again.commands.run(BOOT_ID).stdout.strip() == boot_id

        # Filesystem only.
        assert timed("fs pause", timings, lambda: again.pause(mode="filesystem")) is True
        info = detail(api, sid)
        assert (info["state"], info["pauseMode"]) == ("paused", "filesystem")
        listed = Sandbox.list(query=SandboxQuery(state=[SandboxState.PAUSED]), request_timeout=RT)
        assert sid in {s.sandbox_id for s in listed.next_items()}
        assert Sandbox.get_info(sid, request_timeout=RT).state == SandboxState.PAUSED
        # Nothing of its RAM is kept on disk.
        assert paused_kind(server, rid) == "disk"
        assert not (workdir / "memory").exists() and not (workdir / "state").exists()
        # Traffic does not wake it although its create asked for auto-resume (as E2B).
        proxied = httpx.get(
            f"{server.url}/health",
            headers={"E2B-Sandbox-Id": sid, "E2B-Sandbox-Port": "49983"},
            timeout=60,
        )
        assert proxied.status_code == 502, proxied.text
        assert detail(api, sid)["state"] == "paused"

        back = timed(
            "fs resume", timings, lambda: Sandbox.connect(sid, timeout=600, request_timeout=RT)
        )
        assert isinstance(back, Sandbox) and back.sandbox_id == sid
        assert back.files.read("/home/user/kept.txt") == "on disk"
        assert back.commands.run(FIND_SLEEPER).stdout.strip() == "", "the process survived"
        assert back.commands.run(BOOT_ID).stdout.strip() != boot_id, "it did not boot"
        assert back.commands.run("echo $FOO").stdout.strip() == "from-create"
        assert runtime_id(back) == rid
        info = detail(api, sid)
        assert info["state"] == "running" and "pauseMode" not in info
        assert info["envdAccessToken"] == token and info["metadata"] == {"who": "fs"}
        # envd has the sandbox's token again: a request without it is refused.
        anon = httpx.get(
            f"{server.url}/files",
            params={"path": "/home/user/kept.txt"},
            headers={"E2B-Sandbox-Id": sid, "E2B-Sandbox-Port": "49983"},
            timeout=60,
        )
        assert anon.status_code == 401, anon.text
        assert egress_table_in_slot(server, rid), "the egress policy was not set again"
        assert not (workdir / "paused.json").exists()

        # A booted guest pauses and resumes with memory like any other.
        back.commands.run(SLEEPER, background=True, timeout=0)
        # Its RAM is a file of its own now: a memory pause saves device state only.
        assert timed("memory pause (own RAM file)", timings, back.pause) is True
        third = timed(
            "memory resume (own RAM file)",
            timings,
            lambda: Sandbox.connect(sid, request_timeout=RT),
        )
        assert third.commands.run(FIND_SLEEPER).stdout.strip()

        # `on_resume="reboot"` on a running sandbox does nothing; on a memory pause it drops
        # the memory and boots from the disk (writes the guest had not flushed may be lost,
        # as on E2B: this one is synced).
        assert Sandbox.connect(sid, on_resume="reboot", request_timeout=RT).sandbox_id == sid
        assert third.commands.run(FIND_SLEEPER).stdout.strip(), "a running sandbox rebooted"
        boot_id = third.commands.run(BOOT_ID).stdout.strip()
        third.files.write("/home/user/second.txt", "synced")
        third.commands.run("sync")
        assert third.pause() is True
        assert (workdir / "memory").exists()
        rebooted = timed(
            "reboot resume of a memory pause",
            timings,
            lambda: Sandbox.connect(sid, on_resume="reboot", request_timeout=RT),
        )
        assert isinstance(rebooted, Sandbox)
        assert rebooted.files.read("/home/user/second.txt") == "synced"
        assert rebooted.commands.run(FIND_SLEEPER).stdout.strip() == ""
        assert rebooted.commands.run(BOOT_ID).stdout.strip() != boot_id
        assert not (workdir / "state").exists()
    finally:
        print(f"\npause/resume timings (s): {timings}")
        with contextlib.suppress(Exception):
            Sandbox.kill(sid, request_timeout=RT)


def test_filesystem_snapshot_creates_boot_from_its_disk(
    server: ServerProcess, api: httpx.Client
) -> None:
    src = Sandbox.create(template="base", timeout=600, request_timeout=RT)
    child: Sandbox | None = None
    try:
        src.files.write("/home/user/snap.txt", "captured")
        src.commands.run(SLEEPER, background=True, timeout=0)
        t0 = time.monotonic()
        snap = src.create_snapshot(mode="filesystem")
        took = time.monotonic() - t0
        print(f"\nfilesystem-only snapshot: {took:.3f}s")
        assert snap.snapshot_id and snap.names
        # The source runs on, with its process, and its later writes are its own.
        assert src.commands.run(FIND_SLEEPER).stdout.strip()
        src.files.write("/home/user/snap.txt", "changed after")
        ids = {s.snapshot_id for s in Sandbox.list_snapshots(request_timeout=RT).next_items()}
        assert snap.snapshot_id in ids

        t0 = time.monotonic()
        child = Sandbox.create(snap.snapshot_id, timeout=600, request_timeout=RT)
        print(f"create from it (a cold boot): {time.monotonic() - t0:.3f}s")
        assert child.files.read("/home/user/snap.txt") == "captured"
        assert child.commands.run(FIND_SLEEPER).stdout.strip() == ""
        assert runtime_id(child) != runtime_id(src)
        assert child.commands.run("echo ok").stdout.strip() == "ok"
        # The child's envd has its own token.
        assert detail(api, child.sandbox_id)["envdAccessToken"]
        # It pauses and resumes like any sandbox.
        assert child.pause() is True
        assert Sandbox.connect(child.sandbox_id, request_timeout=RT).files.read(
            "/home/user/snap.txt"
        ) == ("captured")
    finally:
        for s in (child, src):
            if s is not None:
                with contextlib.suppress(Exception):
                    s.kill()
    assert Sandbox.delete_snapshot(snap.snapshot_id, request_timeout=RT) is True


def test_auto_pause_without_memory_then_connect(server: ServerProcess, api: httpx.Client) -> None:
    sbx = Sandbox.create(
        template="base",
        timeout=8,
        lifecycle={"on_timeout": {"action": "pause", "mode": "filesystem"}},
        request_timeout=RT,
    )
    sid = sbx.sandbox_id
    try:
        rid = runtime_id(sbx)
        sbx.files.write("/home/user/auto.txt", "before the timeout")
        sbx.commands.run(SLEEPER, background=True, timeout=0)
        deadline = time.monotonic() + 120
        state = None
        while time.monotonic() < deadline:
            state = Sandbox.get_info(sid, request_timeout=RT).state
            if state == SandboxState.PAUSED:
                break
            time.sleep(1)
        assert state == SandboxState.PAUSED
        assert detail(api, sid)["pauseMode"] == "filesystem"
        assert paused_kind(server, rid) == "disk"
        back = Sandbox.connect(sid, timeout=600, request_timeout=RT)
        assert back.files.read("/home/user/auto.txt") == "before the timeout"
        assert back.commands.run(FIND_SLEEPER).stdout.strip() == ""
        assert detail(api, sid)["state"] == "running"
        logs = api.get(f"/sandboxes/{sid}/logs").json()["logs"]
        lines = [entry["line"] for entry in logs]
        assert "paused (filesystem only)" in lines and "paused on timeout" in lines, lines
    finally:
        with contextlib.suppress(Exception):
            Sandbox.kill(sid, request_timeout=RT)
