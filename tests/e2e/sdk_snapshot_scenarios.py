"""E2B SDK snapshot scenarios (e2b-protocol.md §5: pause/resume, auto-pause, snapshots, fork),
run as a script by tests/e2e/test_snapshots_sdk.py in the project venv (the pinned SDK).

    python sdk_snapshot_scenarios.py --leg before|after|v1 --out results.json --state state.json

`before` leaves one sandbox paused and writes what it held to the state file; `after` (run
against a restarted server) resumes it and checks that nothing was lost. `v1` runs the pause,
snapshot, fork and auto-pause scenarios under e2b 2.50 (from tests/e2e/test_sdk.py).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
from e2b import Sandbox, SandboxQuery, SandboxState

sys.path.insert(0, str(Path(__file__).parent))
from sdk_scenarios import URL, Run, check

PORT = 8000
# Keeps a random secret only in its memory and serves it over HTTP.
SECRET_SERVER = r"""
import http.server, os
secret = os.urandom(8).hex()
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = secret.encode()
        self.send_response(200)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a):
        pass
http.server.ThreadingHTTPServer(("0.0.0.0", PORT), H).serve_forever()
""".replace("PORT", str(PORT))


def secret_via_proxy(sandbox_id: str, limit_s: float = 60) -> str:
    """The in-guest server's secret, through the server's proxy (bounded retries)."""
    hdrs = {"e2b-sandbox-id": sandbox_id, "e2b-sandbox-port": str(PORT)}
    deadline = time.monotonic() + limit_s
    with httpx.Client(base_url=URL, timeout=60, trust_env=False) as c:
        while True:
            resp = c.get("/", headers=hdrs)
            if resp.status_code == 200 or time.monotonic() > deadline:
                break
            time.sleep(0.3)
    check(resp.status_code == 200 and len(resp.text) == 16, f"{resp.status_code} {resp.text}")
    return resp.text


def prepare(s: Sandbox) -> dict[str, str]:
    """A file, a background process and an in-memory secret in `s`."""
    s.files.write("/home/user/marker", "kept")
    s.files.write("/tmp/secret_server.py", SECRET_SERVER)
    h = s.commands.run("python3 /tmp/secret_server.py", background=True, timeout=0)
    return {"id": s.sandbox_id, "pid": str(h.pid), "secret": secret_via_proxy(s.sandbox_id)}


def verify(s: Sandbox, held: dict[str, str]) -> None:
    check(s.files.read("/home/user/marker") == "kept", "file lost")
    out = s.commands.run(f"cat /proc/{held['pid']}/cmdline | tr '\\0' ' '").stdout
    check("secret_server.py" in out, f"background process lost: {out!r}")
    check(secret_via_proxy(s.sandbox_id) == held["secret"], "in-memory secret lost")


def random32(s: Sandbox) -> str:
    return s.commands.run("head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \\n'").stdout


def pause_and_connect(r: Run) -> None:
    s = Sandbox.create(template="base", timeout=600, request_timeout=300)
    r.state["s"] = s
    held = r.state["held"] = prepare(s)
    t0 = time.monotonic()
    check(s.pause() is True, "pause")
    r.state["pause_s"] = time.monotonic() - t0
    check(s.pause() is False, "second pause must say already paused")
    paused = Sandbox.list(query=SandboxQuery(state=[SandboxState.PAUSED])).next_items()
    check(s.sandbox_id in {p.sandbox_id for p in paused}, "not listed as paused")
    t0 = time.monotonic()
    s2 = Sandbox.connect(s.sandbox_id, timeout=600)
    r.state["connect_resume_s"] = time.monotonic() - t0
    verify(s2, held)
    r.state["s"] = s2


def ten_cycles(r: Run) -> None:
    s: Sandbox = r.state["s"]
    for i in range(10):
        check(s.pause() is True, f"pause {i}")
        s = Sandbox.connect(s.sandbox_id, timeout=600)
        s.commands.run(f"echo {i} >> /home/user/cycles")
        verify(s, r.state["held"])
    got = s.files.read("/home/user/cycles").split()
    check(got == [str(i) for i in range(10)], f"cycles {got}")
    r.state["s"] = s


def persistent_snapshot(r: Run) -> None:
    s: Sandbox = r.state["s"]
    snap = s.create_snapshot()
    check(snap.snapshot_id and snap.names, repr(snap))
    s.files.write("/home/user/marker", "changed after the snapshot")
    child = Sandbox.create(snap.snapshot_id, timeout=120, request_timeout=300)
    try:
        verify(child, r.state["held"])
        ids = [x.snapshot_id for x in Sandbox.list_snapshots().next_items()]
        check(snap.snapshot_id in ids, f"not listed: {ids}")
    finally:
        child.kill()
    s.files.write("/home/user/marker", "kept")
    check(Sandbox.delete_snapshot(snap.snapshot_id) is True, "delete")
    check(Sandbox.delete_snapshot(snap.snapshot_id) is False, "second delete")


def fork_eight(r: Run) -> None:
    fork_n(r, 8)


def fork_two(r: Run) -> None:
    fork_n(r, 2)


def fork_n(r: Run, n: int) -> None:
    s: Sandbox = r.state["s"]
    t0 = time.monotonic()
    kids = s.fork(count=n, timeout=120)
    r.state[f"fork{n}_s"] = time.monotonic() - t0
    errors = [k for k in kids if isinstance(k, Exception)]
    check(not errors and len(kids) == n, f"fork errors: {errors}")
    try:
        ids, hosts, rand = set(), set(), set()
        for k in kids:
            assert isinstance(k, Sandbox)
            check(k.files.read("/home/user/marker") == "kept", "child lost the parent's file")
            ids.add(k.sandbox_id)
            hosts.add(k.commands.run("hostname").stdout.strip())
            rand.add(random32(k))
        check(len(ids) == n and s.sandbox_id not in ids, f"ids {ids}")
        check(len(hosts) == n, f"hostnames {hosts}")
        check(len(rand) == n, "children share their RNG output")
        verify(s, r.state["held"])
    finally:
        for k in kids:
            if isinstance(k, Sandbox):
                with contextlib.suppress(Exception):
                    k.kill()


def auto_pause_then_connect(r: Run) -> None:
    s = Sandbox.create(
        template="base",
        timeout=300,
        lifecycle={"on_timeout": "pause", "auto_resume": True},
        request_timeout=300,
    )
    try:
        held = prepare(s)
        # The short timeout starts once the guest's server is up: on a loaded host the
        # preparation alone can outlast it, and its own polls through the proxy would then
        # auto-resume the sandbox this waits to see paused.
        s.set_timeout(6)
        deadline = time.monotonic() + 60
        state = None
        while time.monotonic() < deadline:
            state = Sandbox.get_info(s.sandbox_id).state
            if state == SandboxState.PAUSED:
                break
            time.sleep(1)
        check(state == SandboxState.PAUSED, f"state {state}")
        # Proxy auto-resume: a request to the in-guest server wakes the sandbox.
        check(secret_via_proxy(s.sandbox_id) == held["secret"], "auto-resume lost the secret")
        check(Sandbox.get_info(s.sandbox_id).state == SandboxState.RUNNING, "not running")
        check(s.pause() is True, "pause")
        s2 = Sandbox.connect(s.sandbox_id, timeout=60)
        verify(s2, held)
    finally:
        with contextlib.suppress(Exception):
            Sandbox.kill(s.sandbox_id)


def leave_paused(r: Run) -> None:
    s: Sandbox = r.state["s"]
    check(s.pause() is True, "pause before restart")
    r.state["keep"] = True


def resume_after_restart(r: Run) -> None:
    held = r.state["held"]
    s = Sandbox.connect(held["id"], timeout=120)
    verify(s, held)
    s.kill()


LEGS: dict[str, list[tuple[str, Callable[[Run], None]]]] = {
    "before": [
        ("pause_and_connect", pause_and_connect),
        ("ten_cycles", ten_cycles),
        ("persistent_snapshot", persistent_snapshot),
        ("fork_eight", fork_eight),
        ("auto_pause_then_connect", auto_pause_then_connect),
        ("leave_paused", leave_paused),
    ],
    "after": [("resume_after_restart", resume_after_restart)],
    # e2b 2.50 (tests/e2e/test_sdk.py): resume by the v1 connect, creates by the v1 route.
    "v1": [
        ("pause_and_connect", pause_and_connect),
        ("persistent_snapshot", persistent_snapshot),
        ("fork_two", fork_two),
        ("auto_pause_then_connect", auto_pause_then_connect),
    ],
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--leg", choices=sorted(LEGS), required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--state", required=True)
    args = parser.parse_args()
    run = Run()
    if args.leg == "after":
        run.state["held"] = json.loads(Path(args.state).read_text())
    for name, fn in LEGS[args.leg]:
        run.scenario(name, lambda fn=fn: fn(run))
        if not run.results[-1]["ok"] and name == "pause_and_connect":
            break
    if args.leg != "after":
        if "held" in run.state:
            Path(args.state).write_text(json.dumps(run.state["held"]))
        s = run.state.get("s")
        if s is not None and not run.state.get("keep"):
            with contextlib.suppress(Exception):
                s.kill()
    timings: dict[str, Any] = {k: v for k, v in run.state.items() if k.endswith("_s")}
    with open(args.out, "w") as fh:
        json.dump({"results": run.results, "timings": timings}, fh, indent=2)


if __name__ == "__main__":
    main()
