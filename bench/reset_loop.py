"""Reset one sandbox `--resets` times in a loop (#24's acceptance): after each reset its files
and processes are exactly those of its creation state, its id, token and URL are the same, and
what the host spends on it stays flat (network slots, QEMU processes, the QEMU's PSS, host
available memory, the server's RSS).

Each round, the episode writes a file under /home/user and leaves a background process
running; then `Rollouts.reset` puts the sandbox back. The creation state is read the same way
right after the create: the files under /home/user and /tmp (names, sizes) and the names of
the guest's user processes. Exit status 1 if any round differs from it, or if anything grew.

    .venv/bin/python bench/reset_loop.py [--resets 20] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from e2b import Sandbox
from load import pss_kb  # bench/load.py, beside this script

from agentenv.api.devserver import ServerProcess
from agentenv.rollouts import Rollouts
from agentenv.template.datadir import prepare_home

STATE_CMD = (
    "find /home/user /tmp -xdev -printf '%p %s\\n' | sort; echo ---; "
    # User processes only: kernel threads (pid 2 and its children) rename with their work.
    "ps --ppid 2 --pid 2 -N -o comm= | sort"
)


def _guest_state(sbx: Sandbox) -> str:
    return sbx.commands.run(STATE_CMD, timeout=60).stdout


def _pids_of_qemu(home: Path) -> list[int]:
    out = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if cmd and cmd[0].endswith(b"qemu-system-x86_64") and str(home).encode() in b" ".join(cmd):
            out.append(int(proc.name))
    return out


def _field_kb(path: str, name: str) -> int:
    for line in Path(path).read_text().splitlines():
        if line.startswith(name + ":"):
            return int(line.split()[1])
    return 0


def _host(home: Path, server_pid: int) -> dict[str, int]:
    qemus = _pids_of_qemu(home)
    return {
        "slots": len(list((home / "run" / "slots").glob("*"))),
        "qemu_processes": len(qemus),
        "qemu_pss_mb": sum(pss_kb(p) for p in qemus) // 1024,
        "host_available_mb": _field_kb("/proc/meminfo", "MemAvailable") // 1024,
        "server_rss_mb": _field_kb(f"/proc/{server_pid}/status", "VmRSS") // 1024,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--resets", type=int, default=20)
    ap.add_argument("--json", type=Path, help="write the results here too")
    args = ap.parse_args()
    if args.resets < 1:
        print("error: --resets must be at least 1", file=sys.stderr)
        return 2
    rounds: list[dict[str, Any]] = []
    problems: list[str] = []
    with tempfile.TemporaryDirectory(prefix="aenv-bench-reset-") as tmp:
        home = prepare_home(Path(tmp))
        env = {"AGENTENV_WARM_LOW": "0", "AGENTENV_WARM_HIGH": "0"}
        with ServerProcess(home, env=env, ready_timeout_s=300) as server:
            assert server.proc is not None
            opts: dict[str, Any] = {
                "api_key": server.api_key,
                "api_url": server.url,
                "sandbox_url": server.url,
            }
            sbx = Sandbox.create(template="base", timeout=1800, request_timeout=600, **opts)
            try:
                created = _guest_state(sbx)
                host = sbx.get_host(49983)
                rest = httpx.Client(
                    base_url=server.url, headers={"X-API-Key": server.api_key}, timeout=60
                )
                with Rollouts(server.url, server.api_key) as api, rest:
                    token = rest.get(f"/sandboxes/{sbx.sandbox_id}").json()["envdAccessToken"]
                    start = _host(home, server.proc.pid)
                    for i in range(args.resets):
                        sbx.files.write(f"/home/user/episode-{i}.txt", "x" * 1000)
                        sbx.commands.run("sleep 1000", background=True)
                        t0 = time.monotonic()
                        same = api.reset(sbx.sandbox_id)
                        reset_s = time.monotonic() - t0
                        row = rest.get(f"/sandboxes/{sbx.sandbox_id}").json()
                        state = _guest_state(sbx)
                        now = _host(home, server.proc.pid)
                        ok = (
                            same == sbx.sandbox_id
                            and row["envdAccessToken"] == token
                            and sbx.get_host(49983) == host
                            and state == created
                        )
                        if not ok:
                            diff = sorted(set(state.splitlines()) ^ set(created.splitlines()))
                            problems.append(f"round {i}: differs: {diff[:8]}")
                        rounds.append({"round": i, "reset_s": round(reset_s, 2), "ok": ok, **now})
                        print(json.dumps(rounds[-1]), flush=True)
            finally:
                sbx.kill()
    end = rounds[-1]
    for key in ("slots", "qemu_processes"):
        if end[key] != start[key]:
            problems.append(f"{key}: {start[key]} before the loop, {end[key]} after")
    # PSS and memory move with the page cache and TCG's code cache: a leak of a VM per reset
    # would add hundreds of MB over the loop; 64 MB of drift is not that.
    if end["qemu_pss_mb"] - start["qemu_pss_mb"] > 64:
        problems.append(f"QEMU PSS {start['qemu_pss_mb']} -> {end['qemu_pss_mb']} MB")
    times = sorted(r["reset_s"] for r in rounds)
    summary = {
        "resets": args.resets,
        "all_ok": all(r["ok"] for r in rounds),
        "reset_p50_s": times[len(times) // 2],
        "reset_max_s": times[-1],
        "before": start,
        "after": end,
        "problems": problems,
    }
    print(json.dumps(summary))
    if args.json:
        args.json.write_text(json.dumps({"summary": summary, "rounds": rounds}))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
