"""#24's fork acceptance at full scale: fork N (8) children from a paused sandbox (twice: the
second reuses the first one's snapshot of the paused state) and N from a persistent snapshot
through the API, check that each has the parent's files, processes and memory and a distinct
/dev/urandom, and that the parent, paused throughout, resumes with its own state. Times each
fork and the checks; the server's and the machine's CPU per child.

    .venv/bin/python bench/fork_paused.py [--count 8] [--json out.json]

tests/api/test_control.py runs the same at 2 + 2.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
from e2b import Sandbox

from agentenv.api.devserver import ServerProcess
from agentenv.rollouts import Rollouts
from agentenv.template.datadir import prepare_home

CLK_TCK = os.sysconf("SC_CLK_TCK")
FILE = "/home/user/task.txt"
RAM = "/tmp/ram.txt"
# The bracket keeps pgrep from finding the shell that runs the probe (its command line).
PROBE = f"cat {FILE}; echo; cat {RAM}; pgrep -f 'sleep 360[1]' >/dev/null && echo proc"


def _proc_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def _machine_busy_s() -> float:
    ticks = [int(p) for p in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    return (sum(ticks[:8]) - ticks[3] - ticks[4]) / CLK_TCK


def _check(kids: list[str], want: list[str], opts: dict[str, Any], seen: set[str]) -> list[str]:
    """What is wrong with the children (empty: nothing); each is killed after its check."""
    wrong = []
    for kid in kids:
        try:
            child = Sandbox.connect(kid, **opts)
            got = child.commands.run(PROBE).stdout.split()
            if got != want:
                wrong.append(f"{kid}: {got} != {want}")
            rnd = child.commands.run("head -c 16 /dev/urandom | od -An -tx1").stdout.strip()
            if not rnd or rnd in seen:
                wrong.append(f"{kid}: /dev/urandom repeats a sibling's ({rnd!r})")
            seen.add(rnd)
            child.commands.run(f"echo child > {FILE}; echo child > {RAM}")
        except Exception as exc:
            wrong.append(f"{kid}: {type(exc).__name__}: {exc}")
        finally:
            Sandbox.kill(kid, **opts)
    return wrong


def run(server: ServerProcess, count: int) -> dict[str, Any]:
    assert server.proc is not None
    opts: dict[str, Any] = {
        "api_key": server.api_key,
        "api_url": server.url,
        "sandbox_url": server.url,
    }
    disk, ram = secrets.token_hex(8), secrets.token_hex(8)
    want = [disk, ram, "proc"]
    out: dict[str, Any] = {"count": count, "errors": []}
    seen: set[str] = set()
    headers = {"X-API-Key": server.api_key}
    with (
        Rollouts(server.url, server.api_key, timeout_s=900) as api,
        httpx.Client(base_url=server.url, headers=headers, timeout=900) as http,
    ):
        sid = api.create("base", timeout=1800)
        snap = ""
        try:
            parent = Sandbox.connect(sid, **opts)
            parent.files.write(FILE, disk)
            parent.commands.run(f"echo {ram} > {RAM}")
            parent.commands.run("sleep 3601", background=True)
            resp = http.post(f"/sandboxes/{sid}/snapshots", json={})
            resp.raise_for_status()
            snap = str(resp.json()["snapshotID"])
            http.post(f"/sandboxes/{sid}/pause").raise_for_status()
            forks: list[tuple[str, Callable[[], list[str]]]] = [
                ("paused", lambda: api.fork(sid, count, timeout=900)),
                # The same paused state again: its snapshot is reused, nothing copied.
                ("paused_again", lambda: api.fork(sid, count, timeout=900)),
                ("snapshot", lambda: api.fork_snapshot(snap, count, timeout=900)),
            ]
            for what, fork in forks:
                cpu0, busy0 = _proc_cpu_s(server.proc.pid), _machine_busy_s()
                t0 = time.monotonic()
                kids = fork()
                fork_s = time.monotonic() - t0
                cpu = _proc_cpu_s(server.proc.pid) - cpu0
                busy = _machine_busy_s() - busy0
                t0 = time.monotonic()
                wrong = _check(kids, want, opts, seen)
                out[what] = {
                    "children": len(kids),
                    "fork_s": round(fork_s, 2),
                    "per_child_s": round(fork_s / max(1, len(kids)), 2),
                    "server_cpu_ms_per_child": round(1000 * cpu / max(1, len(kids))),
                    "machine_cpu_ms_per_child": round(1000 * busy / max(1, len(kids))),
                    "check_s": round(time.monotonic() - t0, 1),
                    "wrong": wrong,
                }
                out["errors"] += wrong
                state = http.get(f"/sandboxes/{sid}").json()["state"]
                if state != "paused":
                    out["errors"].append(f"the parent is {state} after the {what} fork")
            back = Sandbox.connect(sid, **opts)
            got = back.commands.run(PROBE).stdout.split()
            if got != want:
                out["errors"].append(f"the resumed parent has {got}, not {want}")
            out["distinct_urandom"] = len(seen)
        finally:
            api.kill(sid)
            if snap:
                http.delete(f"/templates/{snap}")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--count", type=int, default=8, help="children of each fork (1-100)")
    ap.add_argument("--json", type=Path, help="write the results here too")
    args = ap.parse_args()
    if not 1 <= args.count <= 100:
        print("error: --count must be between 1 and 100", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="aenv-bench-fork-") as tmp:
        home = prepare_home(Path(tmp))
        with ServerProcess(home, ready_timeout_s=300) as server:
            result = run(server, args.count)
    print(json.dumps(result, indent=1))
    if args.json:
        args.json.write_text(json.dumps(result))
    ok = not result["errors"] and result.get("distinct_urandom") == 3 * args.count
    print(f"\n{'PASS' if ok else 'FAIL'}: 2 x {args.count} from a paused sandbox, "
          f"{args.count} from a persistent snapshot")  # fmt: skip
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
