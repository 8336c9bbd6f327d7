"""RL rollouts three ways, side by side in one run: episodes per minute, step latency, CPU.

An episode starts from one saved task state (a persistent snapshot the bench makes: a file
written into a fresh sandbox), takes `--steps` tool-call steps (`commands.run` through the
official SDK, each reading the task file and writing a line), and is thrown away. `--workers`
threads each run `--episodes` episodes:

- ``create``: `Sandbox.create(template=<task snapshot>)` per episode, then `kill`;
- ``reset``: one sandbox per worker, `POST /sandboxes/{id}/reset` to the task snapshot between
  episodes (`agentenv.rollouts.Rollouts.reset`);
- ``fork``: batches of `--workers` children of the task snapshot (`POST /snapshots/{task}/fork`,
  one call per batch), dealt to the workers as they free up, each killed after its episode;
  the next batch is forked when the current one is dealt out (no barrier; see the fork section).

For each: episodes/min, per-step latency p50/p99, per-episode setup latency (create, reset, or
the wait for a fork's child: ~0 when its batch was ready, up to a whole fork otherwise)
p50/p99, and CPU per episode: the server process's own; the server's with every process under
it (its helpers and its guests' QEMUs: under TCG the guests dominate it; on a KVM host the
server's share is what carries over), which other load on the host does not enter; and the
whole machine's. The ratios against ``create`` are the numbers to read.

    .venv/bin/python bench/rl.py [--workers 4] [--episodes 5] [--steps 3] [--json out.json]
    # full scale on a big host: --workers 64 --episodes 50 --steps 10
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from e2b import Sandbox

from agentenv.api.devserver import ServerProcess
from agentenv.rollouts import Rollouts
from agentenv.template.datadir import prepare_home

TASK = "rl-task"
TASK_FILE = "/home/user/task.txt"
SANDBOX_TIMEOUT_S = 900
CLK_TCK = os.sysconf("SC_CLK_TCK")


@dataclass
class Mode:
    name: str
    episodes: int = 0
    errors: list[str] = field(default_factory=list)
    step_s: list[float] = field(default_factory=list)
    setup_s: list[float] = field(default_factory=list)
    wall_s: float = 0.0
    server_cpu_s: float = 0.0
    tree_cpu_s: float = 0.0
    machine_cpu_s: float = 0.0

    def summary(self, base: Mode | None) -> dict[str, Any]:
        per_min = 60 * self.episodes / self.wall_s if self.wall_s else 0.0
        out: dict[str, Any] = {
            "mode": self.name,
            "episodes": self.episodes,
            "episodes_per_min": round(per_min, 1),
            "step_p50_ms": _ms(self.step_s, 0.5),
            "step_p99_ms": _ms(self.step_s, 0.99),
            "setup_p50_ms": _ms(self.setup_s, 0.5),
            "setup_p99_ms": _ms(self.setup_s, 0.99),
            "server_cpu_ms_per_episode": _per(self.server_cpu_s, self.episodes),
            "tree_cpu_ms_per_episode": _per(self.tree_cpu_s, self.episodes),
            "machine_cpu_ms_per_episode": _per(self.machine_cpu_s, self.episodes),
            "wall_s": round(self.wall_s, 1),
            "errors": self.errors[:5],
        }
        if base is not None and base.wall_s and base.episodes and self.wall_s:
            out["x_create_episodes_per_min"] = round(
                per_min / (60 * base.episodes / base.wall_s), 2
            )
        return out


def _ms(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    if q == 0.5:
        return round(1000 * statistics.median(ordered), 1)
    return round(1000 * ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))], 1)


def _per(cpu_s: float, n: int) -> float | None:
    return round(1000 * cpu_s / n, 1) if n else None


def _proc_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def _tree_cpu_s(pid: int) -> float:
    """CPU of `pid` and every process under it, those it already reaped included (cutime,
    cstime): the server, its helpers and its guests' QEMUs, and nothing else on the host."""
    children: dict[int, list[int]] = {}
    ticks: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(entry.name))
        ticks[int(entry.name)] = sum(int(f) for f in fields[11:15])
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        total += ticks.get(p, 0)
        todo.extend(children.get(p, []))
    return total / CLK_TCK


def _machine_busy_s() -> float:
    parts = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    ticks = [int(p) for p in parts]
    idle = ticks[3] + ticks[4]
    return (sum(ticks[:8]) - idle) / CLK_TCK


def steps(sbx: Sandbox, n: int, times: list[float], lock: threading.Lock) -> None:
    for i in range(n):
        t0 = time.perf_counter()
        res = sbx.commands.run(f"cat {TASK_FILE} >/dev/null && echo step-{i} >> /tmp/trace")
        dt = time.perf_counter() - t0
        if res.exit_code != 0:
            raise RuntimeError(f"step {i} exited {res.exit_code}: {res.stderr}")
        with lock:
            times.append(dt)


def measure(server: ServerProcess, mode: Mode, workers: int, body: Callable[[int], None]) -> None:
    assert server.proc is not None
    pid = server.proc.pid
    cpu0, tree0, busy0, t0 = _proc_cpu_s(pid), _tree_cpu_s(pid), _machine_busy_s(), time.monotonic()
    threads = [threading.Thread(target=body, args=(w,), daemon=True) for w in range(workers)]
    for t in threads:
        t.start()
    deadline = t0 + 3600
    for t in threads:
        t.join(timeout=max(0.0, deadline - time.monotonic()))
    mode.wall_s = time.monotonic() - t0
    mode.server_cpu_s = _proc_cpu_s(pid) - cpu0
    mode.tree_cpu_s = _tree_cpu_s(pid) - tree0
    mode.machine_cpu_s = _machine_busy_s() - busy0
    if any(t.is_alive() for t in threads):
        mode.errors.append("a worker did not finish within an hour")


def run(args: argparse.Namespace, server: ServerProcess) -> list[Mode]:
    opts: dict[str, Any] = {
        "api_key": server.api_key,
        "api_url": server.url,
        "sandbox_url": server.url,
    }
    api = Rollouts(server.url, server.api_key)
    lock = threading.Lock()
    # The task state every episode starts from.
    seed = Sandbox.create(template="base", timeout=600, request_timeout=600, **opts)
    seed.files.write(TASK_FILE, "the task\n")
    resp = httpx.post(
        f"{server.url}/sandboxes/{seed.sandbox_id}/snapshots",
        json={"name": TASK},
        headers={"X-API-Key": server.api_key},
        timeout=600,
    )
    resp.raise_for_status()
    seed.kill()

    def fail(mode: Mode, what: str, exc: BaseException) -> None:
        with lock:
            mode.errors.append(f"{what}: {type(exc).__name__}: {exc}")

    create = Mode("create")

    def create_worker(_: int) -> None:
        for _ in range(args.episodes):
            t0 = time.perf_counter()
            try:
                sbx = Sandbox.create(template=TASK, timeout=SANDBOX_TIMEOUT_S, **opts)
            except Exception as exc:
                fail(create, "create", exc)
                continue
            with lock:
                create.setup_s.append(time.perf_counter() - t0)
            try:
                steps(sbx, args.steps, create.step_s, lock)
                with lock:
                    create.episodes += 1
            except Exception as exc:
                fail(create, "step", exc)
            finally:
                sbx.kill()

    reset = Mode("reset")

    def reset_worker(_: int) -> None:
        try:
            sbx = Sandbox.create(template=TASK, timeout=SANDBOX_TIMEOUT_S, **opts)
        except Exception as exc:
            fail(reset, "create", exc)
            return
        try:
            for episode in range(args.episodes):
                if episode:
                    t0 = time.perf_counter()
                    api.reset(sbx.sandbox_id, TASK)
                    with lock:
                        reset.setup_s.append(time.perf_counter() - t0)
                steps(sbx, args.steps, reset.step_s, lock)
                with lock:
                    reset.episodes += 1
        except Exception as exc:
            fail(reset, "episode", exc)
        finally:
            sbx.kill()

    fork = Mode("fork")
    # Batches of `--workers` children from the task state (one fork call each), dealt to the
    # workers as they free up. The next batch is forked when the last child of the current
    # one is dealt, so it restores while the current episodes run, as a harness that runs
    # groups of rollouts from one state does; a worker waits only if it is there first. No
    # barrier: nobody waits for the slowest episode of a batch. (So up to 2 x --workers
    # sandboxes live at once here, against --workers in the create mode.)
    dealt: list[str] = []
    dealer = threading.Condition()
    batches = {"ordered": 0, "inflight": False}

    def order_batch() -> None:
        # Under `dealer`.
        batches["ordered"] += args.workers
        batches["inflight"] = True

        def run() -> None:
            got: list[str] = []
            try:
                got = api.fork_snapshot(TASK, args.workers, timeout=SANDBOX_TIMEOUT_S)
            except Exception as exc:
                fail(fork, "fork", exc)
            with dealer:
                dealt.extend(got)
                batches["inflight"] = False
                dealer.notify_all()

        threading.Thread(target=run, daemon=True).start()

    def next_child() -> str | None:
        total = args.workers * args.episodes
        with dealer:
            while True:
                if dealt:
                    child = dealt.pop(0)
                    if not dealt and not batches["inflight"] and batches["ordered"] < total:
                        order_batch()
                    return child
                if not batches["inflight"]:
                    if batches["ordered"] >= total:
                        return None
                    order_batch()
                dealer.wait(timeout=600)

    def fork_worker(_: int) -> None:
        for _ in range(args.episodes):
            t0 = time.perf_counter()
            mine = next_child()
            if mine is None:
                continue
            with lock:
                fork.setup_s.append(time.perf_counter() - t0)
            try:
                steps(Sandbox.connect(mine, **opts), args.steps, fork.step_s, lock)
                with lock:
                    fork.episodes += 1
            except Exception as exc:
                fail(fork, "step", exc)
            finally:
                api.kill(mine)

    modes = []
    for mode, body in ((create, create_worker), (reset, reset_worker), (fork, fork_worker)):
        measure(server, mode, args.workers, body)
        print(json.dumps(mode.summary(create if mode is not create else None)), flush=True)
        modes.append(mode)
    for sandbox_id in dealt:  # none unless a worker gave up early
        api.kill(sandbox_id)
    api.close()
    return modes


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--episodes", type=int, default=5, help="per worker")
    ap.add_argument("--steps", type=int, default=3, help="tool-call steps per episode")
    ap.add_argument("--json", type=Path, help="write the results here too")
    args = ap.parse_args()
    if min(args.workers, args.episodes, args.steps) < 1:
        print("error: --workers, --episodes and --steps must be at least 1", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="aenv-bench-rl-") as tmp:
        home = prepare_home(Path(tmp))
        with ServerProcess(home, ready_timeout_s=300) as server:
            modes = run(args, server)
    base = modes[0]
    rows = [m.summary(base if m is not base else None) for m in modes]
    print(f"\n{args.workers} workers x {args.episodes} episodes x {args.steps} steps")
    for r in rows:
        print(
            f"  {r['mode']:<7} {r['episodes_per_min']:>7} episodes/min "
            f"({r.get('x_create_episodes_per_min', 1.0)}x)  step p50 {r['step_p50_ms']} ms "
            f"p99 {r['step_p99_ms']} ms  setup p50 {r['setup_p50_ms']} ms  server CPU "
            f"{r['server_cpu_ms_per_episode']} ms/episode  server+guests CPU "
            f"{r['tree_cpu_ms_per_episode']} ms/episode  machine CPU "
            f"{r['machine_cpu_ms_per_episode']} ms/episode"
        )
    if args.json:
        args.json.write_text(json.dumps({"modes": rows, "args": vars(args) | {"json": None}}))
    return 0 if not any(m.errors for m in modes) else 1


if __name__ == "__main__":
    sys.exit(main())
