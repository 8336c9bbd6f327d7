"""Host cost per sandbox operation (#23): the server's CPU, its helpers' CPU, and the processes
it spawns, per create, `commands.run` and kill, with the warm pool off and on.

    .venv/bin/python bench/host_cost.py [-n 6] [--runs 5]

For each warm-pool setting a server is started as a child on its own home and a free loopback
port. Two passes of N sandboxes each (create, `--runs` x `commands.run("true")`, kill):

1. CPU: the server's utime+stime from /proc/<pid>/stat around each operation; helpers' CPU
   is the growth of the server's reaped children's times (cutime+cstime) over the pass, less
   the CPU of the QEMU processes (read just before each kill): QEMU is the guest, not a helper.
2. Spawns: `strace -f -e trace=execve` attached to the server; successful execve's by program
   name, per create (QEMU itself counted apart). strace slows the server, so CPU comes from
   pass 1 only. strace comes from Debian's `strace`; it is installed (apt-get) only if missing.

Not yet here: the floor (a bare QEMU restore of the same snapshot from a few lines of script)
and pause/resume rows.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from e2b import Sandbox

from agentenv.api.devserver import ServerProcess, prepare_home

TICK_MS = 1000 / os.sysconf("SC_CLK_TCK")
EXECVE_OK = re.compile(r'execve\("([^"]+)".*\)\s+=\s+0')


def stat_fields(pid: int) -> list[str]:
    raw = Path(f"/proc/{pid}/stat").read_text()
    return raw[raw.rindex(")") + 2 :].split()  # fields from 3 (state) on


def own_ms(pid: int) -> float:
    f = stat_fields(pid)
    return (int(f[11]) + int(f[12])) * TICK_MS  # utime, stime


def children_ms(pid: int) -> float:
    f = stat_fields(pid)
    return (int(f[13]) + int(f[14])) * TICK_MS  # cutime, cstime


def descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        parent = todo.pop()
        for task in Path(f"/proc/{parent}/task").glob("*"):
            try:
                kids = (task / "children").read_text().split()
            except OSError:
                continue
            for kid in map(int, kids):
                out.append(kid)
                todo.append(kid)
    return out


def qemu_ms(server_pid: int) -> float:
    total = 0.0
    for pid in descendants(server_pid):
        try:
            if Path(f"/proc/{pid}/comm").read_text().startswith("qemu"):
                total += own_ms(pid)
        except OSError:
            continue
    return total


def ensure_strace() -> str:
    found = shutil.which("strace")
    if found:
        return found
    print("strace is missing: apt-get install strace", flush=True)
    subprocess.run(["apt-get", "install", "-y", "-qq", "strace"], check=True, timeout=600)
    found = shutil.which("strace")
    assert found, "strace did not install"
    return found


def lifecycle(opts: dict[str, str], runs: int, pid: int, rows: dict[str, list[float]]) -> float:
    """One create, `runs` execs, one kill; appends server CPU per operation; returns the
    QEMU CPU read just before the kill."""
    t0 = own_ms(pid)
    sbx = Sandbox.create(template="base", timeout=300, request_timeout=300, **opts)  # type: ignore[arg-type]
    rows["create"].append(own_ms(pid) - t0)
    for _ in range(runs):
        t0 = own_ms(pid)
        result = sbx.commands.run("true")
        rows["exec"].append(own_ms(pid) - t0)
        assert result.exit_code == 0
    guest = qemu_ms(pid)
    t0 = own_ms(pid)
    sbx.kill()
    rows["kill"].append(own_ms(pid) - t0)
    return guest


def cpu_pass(opts: dict[str, str], n: int, runs: int, pid: int) -> dict[str, float]:
    rows: dict[str, list[float]] = collections.defaultdict(list)
    c0, guest = children_ms(pid), 0.0
    for _ in range(n):
        guest += lifecycle(opts, runs, pid, rows)
    # Killed QEMUs are reaped by now (their CPU is in cutime); a refill may still run.
    helpers = max(0.0, children_ms(pid) - c0 - guest)
    out = {f"server_{k}_ms": round(statistics.mean(v), 2) for k, v in rows.items()}
    out["helpers_per_lifecycle_ms"] = round(helpers / n, 2)
    out["server_per_lifecycle_ms"] = round(
        out["server_create_ms"] + runs * out["server_exec_ms"] + out["server_kill_ms"], 2
    )
    return out


def spawn_pass(opts: dict[str, str], n: int, runs: int, pid: int, log: Path) -> dict[str, float]:
    strace = ensure_strace()
    tracer = subprocess.Popen(
        [strace, "-f", "-qq", "-e", "trace=execve", "-e", "signal=none", "-o", str(log),
         "-p", str(pid)]
    )  # fmt: skip
    try:
        time.sleep(1.0)  # strace attaches to every thread before it reports anything
        rows: dict[str, list[float]] = collections.defaultdict(list)
        for _ in range(n):
            lifecycle(opts, runs, pid, rows)
    finally:
        tracer.terminate()
        tracer.wait(timeout=30)
    names: collections.Counter[str] = collections.Counter()
    for line in log.read_text().splitlines():
        m = EXECVE_OK.search(line)
        if m:
            names[Path(m.group(1)).name] += 1
    return {name: round(count / n, 2) for name, count in names.most_common()}


def measure(warm: bool, n: int, runs: int, tmp: Path) -> dict[str, object]:
    env = {"AGENTENV_WARM_LOW": "1" if warm else "0", "AGENTENV_WARM_HIGH": "2" if warm else "0"}
    home = prepare_home(tmp / ("warm" if warm else "cold"))
    with ServerProcess(home, env=env, ready_timeout_s=180) as server:
        assert server.proc is not None
        pid = server.proc.pid
        opts = {"api_key": server.api_key, "api_url": server.url, "sandbox_url": server.url}
        lifecycle(opts, 1, pid, collections.defaultdict(list))  # warm-up: template, caches
        cpu = cpu_pass(opts, n, runs, pid)
        spawns = spawn_pass(opts, n, runs, pid, home / "execve.log")
    return {"cpu": cpu, "spawns_per_lifecycle": spawns}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("-n", type=int, default=6, help="sandboxes per pass")
    parser.add_argument("--runs", type=int, default=5, help="commands.run per sandbox")
    args = parser.parse_args()
    report: dict[str, object] = {}
    with tempfile.TemporaryDirectory(prefix="aenv-hostcost-") as tmp:
        for warm in (False, True):
            key = "warm_on" if warm else "warm_off"
            report[key] = measure(warm, args.n, args.runs, Path(tmp))
            print(key, json.dumps(report[key]), flush=True)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
