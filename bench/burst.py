"""A burst of creates against a node that holds fewer at a time: does every create succeed
or get told exactly why, and does none time out in the SDK?

`--clients` threads (200) each run one episode through the official E2B SDK, all at once:
`Sandbox.create` (the SDK's own defaults: 60 s request timeout, its retries off so every
answer is counted), `--steps` `commands.run` calls, `kill`. The server holds
`--max-sandboxes` (16) at a time (AGENTENV_MAX_SANDBOXES). Three passes in the same run:

- ``queue``: the node's capacity wait on (AGENTENV_CAPACITY_WAIT_S, 30 s by default): a
  create that does not fit waits, in arrival order, for an episode to end;
- ``allowance``: the same server, and every create asks for a longer wait of its own
  (`X-Capacity-Wait: --allowance`, 300 s, through the SDK's `api_headers`, its request timeout
  raised to match): every create should succeed;
- ``no-wait``: the baseline, AGENTENV_CAPACITY_WAIT_S=0 (what the node did before: 503 at
  once).

For each: episodes done, refusals (503 with the server's reason), team refusals (429), SDK
timeouts and other errors, create latency p50/p99/max, wall time and episodes/min, and the
reorder: clients send their creates `STAGGER_S` apart, and `max_reorder` is the largest
difference between a client's rank in sending and its rank in getting its sandbox (starts run
two at a time and boot times vary, so a few places is what FIFO admission looks like). The
numbers to read are `done / clients` per pass, and that no pass has a timeout.

    .venv/bin/python bench/burst.py [--clients 200] [--max-sandboxes 16] [--steps 2]
        [--wait 30] [--allowance 300] [--passes queue,allowance,no-wait] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from e2b import Sandbox
from e2b.exceptions import RateLimitException, ServiceBusyException, TimeoutException

from agentenv.api.devserver import ServerProcess
from agentenv.template.datadir import prepare_home

SANDBOX_TIMEOUT_S = 600
# Clients send their creates this far apart, so arrival order is known to the bench.
STAGGER_S = 0.02
# A thread's whole episode is bounded by the SDK's request timeouts (60 s each by default);
# this bounds the join, so a stuck client cannot hang the bench.
EPISODE_BOUND_S = 900.0


@dataclass
class Pass:
    name: str
    clients: int
    capacity_wait_s: int
    done: int = 0
    refused: list[str] = field(default_factory=list)
    rate_limited: int = 0
    timeouts: int = 0
    errors: list[str] = field(default_factory=list)
    create_s: list[float] = field(default_factory=list)
    # (client's sending rank, monotonic time its create returned) of each success.
    made: list[tuple[int, float]] = field(default_factory=list)
    wall_s: float = 0.0

    def max_reorder(self) -> int:
        by_done = sorted(self.made, key=lambda m: m[1])
        sent_rank = {rank: i for i, rank in enumerate(sorted(r for r, _ in self.made))}
        return max((abs(sent_rank[r] - i) for i, (r, _) in enumerate(by_done)), default=0)

    def summary(self) -> dict[str, Any]:
        times = sorted(self.create_s)

        def pct(q: float) -> float:
            return times[min(len(times) - 1, round(q * (len(times) - 1)))] if times else 0.0

        reasons = Counter(r.split(";")[0][:90] for r in self.refused)
        return {
            "pass": self.name,
            "clients": self.clients,
            "capacity_wait_s": self.capacity_wait_s,
            "done": self.done,
            "refused_503": len(self.refused),
            "refusal_reasons": dict(reasons.most_common(3)),
            "rate_limited_429": self.rate_limited,
            "sdk_timeouts": self.timeouts,
            "errors": self.errors[:5],
            "create_p50_s": round(statistics.median(times), 2) if times else None,
            "create_p99_s": round(pct(0.99), 2),
            "create_max_s": round(times[-1], 2) if times else None,
            "wall_s": round(self.wall_s, 1),
            "episodes_per_min": round(60 * self.done / self.wall_s, 1) if self.wall_s else 0.0,
            "max_reorder": self.max_reorder(),
        }


def run_pass(
    name: str, home: Path, args: argparse.Namespace, wait_s: int, allowance: int | None = None
) -> Pass:
    result = Pass(name, args.clients, wait_s if allowance is None else allowance)
    env = {
        "AGENTENV_MAX_SANDBOXES": str(args.max_sandboxes),
        "AGENTENV_CAPACITY_WAIT_S": str(wait_s),
        "AGENTENV_WARM_LOW": "0",
        "AGENTENV_WARM_HIGH": "0",
    }
    lock = threading.Lock()
    with ServerProcess(home, env=env, ready_timeout_s=300) as server:
        opts: dict[str, Any] = {
            "api_key": server.api_key,
            "api_url": server.url,
            "sandbox_url": server.url,
        }
        # The template snapshot (a cold boot on a fresh data dir) is not part of the burst.
        Sandbox.create(template="base", timeout=120, request_timeout=600, **opts).kill()
        start = threading.Barrier(args.clients)
        own: dict[str, Any] = {}
        if allowance is not None:
            # The SDK's own request timeout must outlast the wait it asks for.
            own = {
                "api_headers": {"X-Capacity-Wait": str(allowance)},
                "request_timeout": allowance + 60,
            }

        def episode(rank: int) -> None:
            start.wait(timeout=120)
            time.sleep(rank * STAGGER_S)
            t0 = time.monotonic()
            try:
                sbx = Sandbox.create(
                    template="base", timeout=SANDBOX_TIMEOUT_S, retries=0, **opts, **own
                )
            except ServiceBusyException as exc:
                with lock:
                    result.refused.append(str(exc))
                return
            except RateLimitException:
                with lock:
                    result.rate_limited += 1
                return
            except (TimeoutException, httpx.TimeoutException):
                with lock:
                    result.timeouts += 1
                return
            except Exception as exc:
                with lock:
                    result.errors.append(f"create: {type(exc).__name__}: {exc}")
                return
            created = time.monotonic() - t0
            try:
                for _ in range(args.steps):
                    sbx.commands.run("true")
                with lock:
                    result.done += 1
                    result.create_s.append(created)
                    result.made.append((rank, t0 + created))
            except Exception as exc:
                with lock:
                    result.errors.append(f"step: {type(exc).__name__}: {exc}")
            finally:
                try:
                    sbx.kill()
                except Exception as exc:
                    with lock:
                        result.errors.append(f"kill: {type(exc).__name__}: {exc}")

        threads = [
            threading.Thread(target=episode, args=(i,), daemon=True) for i in range(args.clients)
        ]
        t0 = time.monotonic()
        for t in threads:
            t.start()
        deadline = t0 + EPISODE_BOUND_S
        for t in threads:
            t.join(timeout=max(0.0, deadline - time.monotonic()))
        result.wall_s = time.monotonic() - t0
        stuck = sum(1 for t in threads if t.is_alive())
        if stuck:
            result.errors.append(f"{stuck} clients still running after {EPISODE_BOUND_S:.0f}s")
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, default=200)
    ap.add_argument("--max-sandboxes", type=int, default=16)
    ap.add_argument("--steps", type=int, default=2, help="commands per episode")
    ap.add_argument("--wait", type=int, default=30, help="AGENTENV_CAPACITY_WAIT_S of the queue")
    ap.add_argument(
        "--allowance", type=int, default=300, help="X-Capacity-Wait of the allowance pass"
    )
    ap.add_argument("--passes", default="queue,allowance,no-wait", help="which, in order")
    ap.add_argument("--json", type=Path, help="write the results here too")
    args = ap.parse_args()
    names = [n.strip() for n in args.passes.split(",") if n.strip()]
    if not names or set(names) - {"queue", "allowance", "no-wait"}:
        print("error: --passes takes queue, allowance and no-wait", file=sys.stderr)
        return 2
    if args.clients < 1 or args.max_sandboxes < 1:
        print("error: --clients and --max-sandboxes must be at least 1", file=sys.stderr)
        return 2
    passes = []
    with tempfile.TemporaryDirectory(prefix="aenv-bench-burst-") as tmp:
        home = prepare_home(Path(tmp))
        for name in names:
            wait = 0 if name == "no-wait" else args.wait
            p = run_pass(name, home, args, wait, args.allowance if name == "allowance" else None)
            print(json.dumps(p.summary()), flush=True)
            passes.append(p)
    out = [p.summary() for p in passes]
    print(f"\n{args.clients} clients, {args.max_sandboxes} at a time:")
    for p in passes:
        print(
            f"  {p.name}: {p.done} done, {len(p.refused)} refused, {p.timeouts} timed out, "
            f"{len(p.errors)} errors, max reorder {p.max_reorder()}"
        )
    if args.json:
        args.json.write_text(json.dumps({"passes": out, "args": vars(args) | {"json": None}}))
    failed = [p for p in passes if p.name != "no-wait" and (p.timeouts or p.errors)]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
