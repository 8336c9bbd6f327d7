"""How a node's work spreads over processes on one host (#23), measured, and the ceiling of a
host of C cores computed from it.

A lifecycle: the official SDK's `Sandbox.create` of `base`, `--runs` x `commands.run("true")`,
`kill`, through one control-plane replica, as many at a time as there are agents. The same
`--n` lifecycles run on a cluster of one node agent, then of two (a second agent joins: its
own data dir, slot range and id; the replica spreads the creates), then through two replicas
(a second one on the same etcd; the lifecycles are dealt to them in turn). Around each phase, from
/proc: the CPU of the replica, of each agent (its own and its live helpers', the VM launcher;
QEMU is the guest, not counted), and of etcd's members; and from etcd's own metrics, the
requests its members answered, by method (`grpc_server_handled_total`: what every process
asked of etcd, counted where it was served). Each process's idle rate, and etcd's idle
request rate, read over `--idle` seconds before the phase (leases, heartbeats), is taken off,
so the rows are per lifecycle.

What it shows: the work per lifecycle of each role (replica, agent, etcd), whether it stays
the same when a role gets a second process (its work then divides between them; etcd's is
the one shared part), and the ceiling of a host of `--cores` cores from those rows: one Python
process is one core at most, so a role's processes needed for R lifecycles/s are
R x its ms / 1000, and a host whose cores all go to these processes reaches
cores x 1000 / (the sum of the rows) lifecycles/s. That is a computation from measured
per-lifecycle CPU, not a measurement at 16 cores: this machine has two, and its TCG guests
take most of them.

    flock /tmp/agentenv-vmtest.lock .venv/bin/python bench/scaling.py \\
        [--n 12] [--runs 5] [--cores 16] [--json out.json]

It boots VMs, so it runs under the VM lock like the VM tests. Processes come from the
harnesses bench/cluster.py uses (a 3-member etcd, the agents, the replica, on loopback;
guests resolve only at the bench's own resolver). The run fails if it left a QEMU, a network
namespace or an nft table behind.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import secrets
import sys
import tempfile
import time
import traceback
import urllib.request
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

from clusterlib import bench_cluster  # first: it puts tests/ on the import path
from e2b import Sandbox
from prometheus_client.parser import text_string_to_metric_families

# isort: split
from cluster.etcd_cluster import EtcdCluster
from cluster_procs import cluster_env, replica
from hostcost import helpers, own_ms
from resolver import TestResolver

from agentenv.template.datadir import prepare_home

Cluster = bench_cluster.Cluster
HostState = bench_cluster.HostState
RT = bench_cluster.RT


def tree_ms(pid: int) -> float:
    """A process's own CPU and its live helpers' (not QEMU's)."""
    return own_ms(pid) + sum(own for own, _reaped in helpers(pid).values())


def roles(cluster: Any, etcd: Any, replicas: list[Any]) -> dict[str, list[int]]:
    return {
        "replicas": [r.pid for r in replicas],
        "agents": [node.proc.pid for node in cluster.nodes],
        "etcd": [m.process.pid for m in etcd.members if m.process is not None],
    }


def sample(pids: dict[str, list[int]]) -> dict[int, float]:
    return {pid: tree_ms(pid) for group in pids.values() for pid in group}


def etcd_requests(etcd: Any) -> Counter[str]:
    """Unary requests etcd's members have answered so far, by method (summed over members;
    a watch or a lease keepalive is a stream, not counted)."""
    total: Counter[str] = Counter()
    for member in etcd.members:
        if member.process is None:
            continue
        with urllib.request.urlopen(f"{member.client_url}/metrics", timeout=10) as answer:
            text = answer.read().decode()
        for family in text_string_to_metric_families(text):
            if family.name != "grpc_server_handled":
                continue
            for sample in family.samples:
                labels = sample.labels
                if sample.name.endswith("_total") and labels.get("grpc_type") == "unary":
                    total[labels["grpc_method"]] += int(sample.value)
    return total


def lifecycle(opts: dict[str, Any], runs: int) -> None:
    sbx = Sandbox.create(template="base", timeout=300, request_timeout=RT, **opts)
    for _ in range(runs):
        assert sbx.commands.run("true").exit_code == 0
    sbx.kill()


def phase(
    cluster: Any, etcd: Any, replicas: list[Any], n: int, runs: int, idle_s: float
) -> dict[str, Any]:
    """`n` lifecycles, as many at a time as there are agents, dealt over `replicas` in turn;
    CPU per lifecycle of each role, idle rates taken off."""
    pids = roles(cluster, etcd, replicas)
    a, ra, t0 = sample(pids), etcd_requests(etcd), time.monotonic()
    time.sleep(idle_s)
    b, rb, t1 = sample(pids), etcd_requests(etcd), time.monotonic()
    idle_rate = {pid: (b[pid] - a[pid]) / (t1 - t0) for pid in a}
    idle_requests = {m: (rb[m] - ra[m]) / (t1 - t0) for m in rb}
    # One key ring in etcd for every replica: the first one's key (only it wrote the file).
    key = replicas[0].api_key
    opts = [{"api_key": key, "api_url": r.url, "sandbox_url": r.url} for r in replicas]
    workers = len(pids["agents"])

    def one(i: int) -> None:
        lifecycle(opts[i % len(opts)], runs)

    # The phase's first lifecycles: each agent's first use of the template (a new agent's
    # conversion of it) is not what the rows are for.
    _all_done(bench_cluster.bounded_pool(one, list(range(max(workers, len(opts)))), workers))
    c, rc, t2 = sample(pids), etcd_requests(etcd), time.monotonic()
    _all_done(bench_cluster.bounded_pool(one, list(range(n)), workers))
    d, rd, t3 = sample(pids), etcd_requests(etcd), time.monotonic()
    wall = t3 - t2
    per_pid = {pid: max(0.0, (d[pid] - c[pid]) - idle_rate[pid] * wall) / n for pid in c}
    requests = {
        m: round(max(0.0, rd[m] - rc[m] - idle_requests.get(m, 0.0) * wall) / n, 1)
        for m in sorted(rd)
        if rd[m] > rc[m]
    }
    row: dict[str, Any] = {
        "replicas": len(replicas),
        "agents": len(pids["agents"]),
        "n": n,
        "wall_s": round(wall, 1),
    }
    for role, group in pids.items():
        row[f"{role}_ms"] = round(sum(per_pid[p] for p in group), 2)
        row[f"{role}_idle_ms_per_s"] = round(sum(idle_rate[p] for p in group), 2)
        row[f"{role}_each_ms"] = [round(per_pid[p], 2) for p in group]
    row["total_ms"] = round(row["replicas_ms"] + row["agents_ms"] + row["etcd_ms"], 2)
    row["etcd_requests"] = requests
    row["etcd_requests_total"] = round(sum(requests.values()), 1)
    return row


def _all_done(results: list[tuple[Any, BaseException | None]]) -> None:
    """A lifecycle that failed (the warm-up's too) ends the run: the rows would be wrong."""
    if errors := [repr(exc) for _r, exc in results if exc is not None]:
        raise RuntimeError(f"{len(errors)} of {len(results)} lifecycles failed: {errors[:3]}")


def ceiling(row: dict[str, Any], cores: int) -> dict[str, Any]:
    """The host's lifecycles/s if all `cores` run these processes, and how many of each."""
    total = row["total_ms"]
    rate = cores * 1000 / total if total else math.inf
    return {
        "cores": cores,
        "lifecycles_per_s": round(rate, 1),
        "replicas": math.ceil(rate * row["replicas_ms"] / 1000),
        "agents": math.ceil(rate * row["agents_ms"] / 1000),
        "etcd_cores": round(rate * row["etcd_ms"] / 1000, 1),
        "per_replica_per_s": round(1000 / row["replicas_ms"], 1) if row["replicas_ms"] else None,
        "per_agent_per_s": round(1000 / row["agents_ms"], 1) if row["agents_ms"] else None,
    }


def table(report: dict[str, Any]) -> str:
    runs = report["runs"]
    lines = [
        "",
        f"host CPU per lifecycle (create, {runs} commands, kill), ms; QEMU not counted",
        f"  {'replicas':>8s} {'agents':>6s} {'replicas':>9s} {'agents':>8s} {'etcd':>7s} "
        f"{'total':>7s}  each replica / each agent",
    ]
    for row in report["phases"]:
        lines.append(
            f"  {row['replicas']:8d} {row['agents']:6d} {row['replicas_ms']:9.2f} "
            f"{row['agents_ms']:8.2f} {row['etcd_ms']:7.2f} {row['total_ms']:7.2f}  "
            f"{row['replicas_each_ms']} / {row['agents_each_ms']}"
        )
    lines += ["", "etcd requests per lifecycle (unary, by method; idle rate taken off)"]
    for row in report["phases"]:
        by_method = ", ".join(f"{m} {v:g}" for m, v in row["etcd_requests"].items())
        lines.append(
            f"  {row['replicas']} replica(s), {row['agents']} agent(s): "
            f"{row['etcd_requests_total']:g} ({by_method})"
        )
    c = report["ceiling"]
    last = report["phases"][-1]
    lines += [
        "",
        f"ceiling of a {c['cores']}-core host from the last row ({last['replicas']} replicas, "
        f"{last['agents']} agents): {c['lifecycles_per_s']} lifecycles/s",
        f"  with {c['replicas']} replica(s) (one alone ~{c['per_replica_per_s']}/s), "
        f"{c['agents']} agent(s) (one alone ~{c['per_agent_per_s']}/s), "
        f"etcd ~{c['etcd_cores']} core(s)",
    ]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=12, help="lifecycles per phase")
    parser.add_argument("--runs", type=int, default=5, help="commands per lifecycle")
    parser.add_argument("--cores", type=int, default=16, help="the host the ceiling is for")
    parser.add_argument("--idle", type=float, default=3.0, help="seconds of idle reading")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    before = HostState.now()
    failures: list[str] = []
    report: dict[str, Any] = {"runs": args.runs, "phases": []}
    with (
        tempfile.TemporaryDirectory(prefix="aenv-bench-scaling-") as tmp,
        TestResolver() as dns,
        EtcdCluster(Path(tmp) / "etcd") as etcd,
    ):
        root = Path(tmp)
        env = cluster_env(etcd.endpoints, secrets.token_urlsafe(16), f"/s{uuid.uuid4().hex[:8]}/")
        env["AGENTENV_DNS"] = dns.address  # guests resolve only at the bench's resolver
        # The warm pool would restore guests between lifecycles, on no one's clock.
        env["AGENTENV_WARM_HIGH"] = env["AGENTENV_WARM_LOW"] = "0"
        cluster = Cluster(env, root)
        extra: list[Any] = []
        try:
            cluster.add_node(0)
            prepare_home(root / "control")
            cluster.server = replica(root / "control", env).start()
            cluster.wait_nodes(1)
            replicas = [cluster.server]
            for step in ("1 replica, 1 agent", "1 replica, 2 agents", "2 replicas, 2 agents"):
                if step == "1 replica, 2 agents":
                    node = cluster.add_node(1)
                    cluster.wait_nodes(2)
                    # Its first create straight on it: placement prefers nodes that hold
                    # the template, and its first use converts it.
                    asyncio.run(bench_cluster.warm_node(node, cluster.token))
                elif step == "2 replicas, 2 agents":
                    prepare_home(root / "control-2")
                    second = replica(root / "control-2", env)
                    extra.append(second)  # stopped at the end even if its start fails
                    replicas.append(second.start())
                print(f"{step}: {args.n} lifecycles", flush=True)
                row = phase(cluster, etcd, replicas, args.n, args.runs, args.idle)
                report["phases"].append(row)
                print(json.dumps(row), flush=True)
        except Exception:
            failures.append(traceback.format_exc())
            failures += cluster.log_tails()
        finally:
            for server in extra:
                code = server.stop(timeout_s=120)
                if code not in (0, -15):
                    failures.append(f"second replica exited with {code}: {server.log_tail()}")
            failures += cluster.stop()
            if left := cluster.node_qemus():
                failures.append(f"QEMUs left in the nodes' data dirs: {left}")
    if report["phases"]:
        report["ceiling"] = ceiling(report["phases"][-1], args.cores)
        print(table(report))
    return int(bench_cluster.conclude(report, failures, before, args.json))


if __name__ == "__main__":
    sys.exit(main())
