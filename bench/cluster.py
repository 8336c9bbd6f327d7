"""What the many-node control plane costs, on one machine, in one run:

1. **Added cost per create**: the same create (template `base`, 1 vCPU, 512 MB, warm pool
   off) N times, one at a time, (a) straight to a node agent over the node RPC
   (`noderpc.client.RemoteRuntime.create`, then `delete`) — the baseline — and (b) through a
   control-plane replica with the official SDK (`Sandbox.create`, then `kill`) on a cluster of
   that same single node. The two alternate, so drift on the host hits both alike. Prints
   p50/p99 of each, their ratio (replica/direct) and the absolute added milliseconds.
2. **Throughput**: K concurrent SDK creates through the replica for a fixed count, with 1 node
   and then with 3 (the same etcd and replica; two more agents, each its own data dir, slot
   range and id); creates/s of each and the 3-node/1-node ratio. Everything is killed after.

    flock /tmp/agentenv-vmtest.lock .venv/bin/python bench/cluster.py \
        [--n 20] [--concurrency 8] [--count 24] [--json out.json] [--logs dir]

It boots VMs, so it runs under the VM lock like the VM tests. Processes (a 3-member etcd, the
node agents, the replica) are started by the harnesses of tests/cluster and tests/e2e,
on loopback only; guests get the bench's own resolver (tests/resolver.py, answers nothing)
as their DNS. Every process is stopped, or killed by PID if it hangs; the run fails if it
left a QEMU, a network namespace or an nft table behind. Ratios, not timed assertions.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from e2b import Sandbox

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "tests" / "e2e"))

from cluster.etcd_cluster import EtcdCluster  # noqa: E402
from cluster_procs import NodeProcess, cluster_env, replica  # noqa: E402
from resolver import TestResolver  # noqa: E402

from agentenv.api.devserver import ServerProcess  # noqa: E402
from agentenv.contract.ids import new_sandbox_id  # noqa: E402
from agentenv.contract.runtime import SandboxSpec  # noqa: E402
from agentenv.noderpc.client import RemoteRuntime  # noqa: E402
from agentenv.template.datadir import prepare_home  # noqa: E402
from agentenv.vmm import registry  # noqa: E402

NODES = ("node-a", "node-b", "node-c")
# Each node its own part of the default slot range, as in tests/e2e/test_cluster.py.
SLOT_CIDRS = ("198.18.64.0/20", "198.18.80.0/20", "198.18.96.0/20")
CPU, MEMORY_MB = 1, 512
RT = 300  # SDK request timeout, s: a create under TCG on a busy 2-core host
SANDBOX_TIMEOUT_S = 600
NODES_READY_S = 60.0
JOIN_SETTLE_S = 3.0
SETTLE_S = 60.0  # after the last kill: QEMUs gone from the nodes' data dirs


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))] if s else float("nan")


def summary(xs: list[float]) -> dict[str, Any]:
    return {
        "n": len(xs),
        "p50_ms": round(pct(xs, 0.5) * 1000, 1),
        "p99_ms": round(pct(xs, 0.99) * 1000, 1),
        "max_ms": round(max(xs) * 1000, 1) if xs else float("nan"),
    }


# -- host state the run must leave as it found it ------------------------------------------


def qemu_count() -> int:
    out = subprocess.run(["pgrep", "-f", "qemu-system"], capture_output=True, text=True)
    return len(out.stdout.split())


def netns_names() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    return {line.split()[0] for line in out.stdout.splitlines() if line.strip()}


def nft_tables() -> set[str]:
    out = subprocess.run(["nft", "list", "tables"], capture_output=True, text=True)
    return {line.strip() for line in out.stdout.splitlines() if line.strip()}


@dataclass(frozen=True)
class HostState:
    qemus: int
    netns: frozenset[str]
    nft: frozenset[str]

    @classmethod
    def now(cls) -> HostState:
        return cls(qemu_count(), frozenset(netns_names()), frozenset(nft_tables()))

    def grown_since(self, before: HostState) -> list[str]:
        grown = []
        if self.qemus > before.qemus:
            grown.append(f"qemu-system processes {before.qemus} -> {self.qemus}")
        if extra := sorted(self.netns - before.netns):
            grown.append(f"network namespaces left: {extra}")
        if extra := sorted(self.nft - before.nft):
            grown.append(f"nft tables left: {extra}")
        return grown


# -- the cluster ---------------------------------------------------------------------------


@dataclass
class Cluster:
    env: dict[str, str]
    root: Path
    nodes: list[NodeProcess] = field(default_factory=list)
    server: ServerProcess | None = None

    @property
    def token(self) -> str:
        return self.env["AGENTENV_NODE_TOKEN"]

    def add_node(self, i: int) -> NodeProcess:
        node = NodeProcess(self.root / NODES[i], NODES[i], SLOT_CIDRS[i], self.env)
        self.nodes.append(node)  # stopped at the end even if its start fails half-way
        node.start()
        return node

    def sdk_opts(self) -> dict[str, Any]:
        assert self.server is not None
        srv = self.server
        return {"api_key": srv.api_key, "api_url": srv.url, "sandbox_url": srv.url}

    def ready_nodes(self) -> dict[str, str]:
        assert self.server is not None
        with httpx.Client(
            base_url=self.server.url,
            headers={"X-API-Key": self.server.api_key},
            timeout=30,
            trust_env=False,
        ) as api:
            resp = api.get("/nodes")
            resp.raise_for_status()
            return {n["nodeID"]: n["state"] for n in resp.json()}

    def wait_nodes(self, want: int) -> None:
        """`want` nodes ready in `GET /nodes`, then a moment more: a joining node is asked by
        the replica what it holds, and a sandbox made on it directly (no binding) in that
        moment would be deleted as stale (`JOIN_SETTLE_S`; `stale_deletes` checks)."""
        deadline = time.monotonic() + NODES_READY_S
        while True:
            seen = self.ready_nodes()
            if sum(1 for s in seen.values() if s == "ready") == want:
                time.sleep(JOIN_SETTLE_S)
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"GET /nodes shows {seen}, wanted {want} ready")
            time.sleep(0.5)

    def holder(self, sandbox_id: str) -> str:
        """The node whose data dir holds the sandbox."""
        held = [n.node_id for n in self.nodes if (n.home / "sandboxes" / sandbox_id).is_dir()]
        return held[0] if len(held) == 1 else f"?{held}"

    def node_qemus(self) -> list[str]:
        return [
            f"{node.node_id}: {pid}"
            for node in self.nodes
            for pid in registry.qemu_processes(str(node.home))
        ]

    def log_tails(self) -> list[str]:
        """The last lines of every process's log (the data dirs go with the run)."""
        tails = [f"--- {n.node_id} log:\n{n.log_tail(30)}" for n in self.nodes]
        if self.server is not None:
            tails.append(f"--- replica log:\n{self.server.log_tail(30)}")
        return tails

    def keep_logs(self, where: Path) -> None:
        where.mkdir(parents=True, exist_ok=True)
        logs = [(n.log_path, f"{n.node_id}.log") for n in self.nodes]
        if self.server is not None:
            logs.append((self.server.log_path, "replica.log"))
        for path, name in logs:
            if path.exists():
                shutil.copyfile(path, where / name)

    def stale_deletes(self) -> list[str]:
        """The replica's lines saying it deleted a sandbox no binding named: the bench's own
        direct creates caught by a join's reconcile (the comparison would be void)."""
        if self.server is None:
            return []
        try:
            text = self.server.log_path.read_text(errors="replace")
        except OSError:
            return []
        return [line for line in text.splitlines() if "bound to no node" in line]

    def stop(self) -> list[str]:
        """Stop the replica, then the agents (SIGTERM; SIGKILL by PID on a hang)."""
        problems = []
        if self.server is not None:
            code = self.server.stop(timeout_s=120)
            if code not in (0, -15):
                problems.append(f"replica exited with {code}: {self.server.log_tail()}")
        for node in self.nodes:
            code = node.stop(timeout_s=120)
            if code not in (0, -15, None):
                problems.append(f"{node.node_id} exited with {code}: {node.log_tail()}")
        return problems


# -- 1. added cost per create --------------------------------------------------------------


def direct_spec() -> SandboxSpec:
    # What the replica sends for an SDK create of `base`: its own id and envd token.
    return SandboxSpec(
        sandbox_id=new_sandbox_id(),
        template="base",
        cpu=CPU,
        memory_mb=MEMORY_MB,
        envd_token=secrets.token_urlsafe(24),
    )


async def direct_create(remote: RemoteRuntime) -> tuple[float, float]:
    spec = direct_spec()
    t0 = time.perf_counter()
    placement = await remote.create(spec)
    created = time.perf_counter() - t0
    t1 = time.perf_counter()
    await remote.delete(placement.sandbox_id)
    return created, time.perf_counter() - t1


def sdk_create(opts: dict[str, Any]) -> tuple[float, Sandbox]:
    t0 = time.perf_counter()
    sbx = Sandbox.create(template="base", timeout=SANDBOX_TIMEOUT_S, request_timeout=RT, **opts)
    return time.perf_counter() - t0, sbx


def sdk_create_kill(opts: dict[str, Any]) -> tuple[float, float]:
    created, sbx = sdk_create(opts)
    t1 = time.perf_counter()
    sbx.kill(request_timeout=RT)
    return created, time.perf_counter() - t1


async def added_cost(cluster: Cluster, n: int) -> dict[str, Any]:
    node = cluster.nodes[0]
    remote = RemoteRuntime(node.url, cluster.token)
    await remote.start()
    opts = cluster.sdk_opts()
    direct: list[float] = []
    through: list[float] = []
    kills: dict[str, list[float]] = {"direct": [], "replica": []}
    try:
        # Untimed: the first create of each path pays for first connections and the
        # template's first use on the node.
        await direct_create(remote)
        await asyncio.to_thread(sdk_create_kill, opts)
        for i in range(n):
            # Alternate which goes first, so neither always follows the other's delete.
            order = ("direct", "replica") if i % 2 == 0 else ("replica", "direct")
            for which in order:
                if which == "direct":
                    created, killed = await direct_create(remote)
                    direct.append(created)
                else:
                    created, killed = await asyncio.to_thread(sdk_create_kill, opts)
                    through.append(created)
                kills[which].append(killed)
            print(
                f"  create {i + 1}/{n}: direct {direct[-1] * 1000:7.0f} ms   "
                f"replica {through[-1] * 1000:7.0f} ms",
                flush=True,
            )
    finally:
        await remote.close()
    d50, d99 = pct(direct, 0.5), pct(direct, 0.99)
    r50, r99 = pct(through, 0.5), pct(through, 0.99)
    return {
        "direct": summary(direct),
        "replica": summary(through),
        "ratio_p50": round(r50 / d50, 3),
        "ratio_p99": round(r99 / d99, 3),
        "added_ms_p50": round((r50 - d50) * 1000, 1),
        "added_ms_p99": round((r99 - d99) * 1000, 1),
        "delete_direct": summary(kills["direct"]),
        "kill_replica": summary(kills["replica"]),
    }


# -- 2. throughput -------------------------------------------------------------------------


def bounded_pool(
    fn: Callable[[Any], Any], items: list[Any], workers: int
) -> list[tuple[Any, BaseException | None]]:
    """`fn` over `items` on `workers` threads; each result or the exception it raised."""

    def guarded(item: Any) -> tuple[Any, BaseException | None]:
        try:
            return fn(item), None
        except BaseException as exc:
            return None, exc

    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        return list(pool.map(guarded, items))


def throughput(cluster: Cluster, concurrency: int, count: int) -> dict[str, Any]:
    opts = cluster.sdk_opts()
    t0 = time.perf_counter()
    results = bounded_pool(lambda _i: sdk_create(opts), list(range(count)), concurrency)
    wall = time.perf_counter() - t0
    made = [r for r, exc in results if exc is None]
    errors = [f"{type(exc).__name__}: {exc}" for _r, exc in results if exc is not None]
    spread: dict[str, int] = {}
    for _lat, sbx in made:
        where = cluster.holder(sbx.sandbox_id)
        spread[where] = spread.get(where, 0) + 1
    kills = bounded_pool(lambda m: m[1].kill(request_timeout=RT), made, concurrency)
    kill_errors = [f"{type(exc).__name__}: {exc}" for _r, exc in kills if exc is not None]
    lats = [lat for lat, _sbx in made]
    return {
        "nodes": len(cluster.nodes),
        "concurrency": concurrency,
        "count": count,
        "created": len(made),
        "wall_s": round(wall, 2),
        "creates_per_s": round(len(made) / wall, 3),
        "latency": summary(lats),
        "spread": dict(sorted(spread.items())),
        "errors": errors,
        "kill_errors": kill_errors,
    }


async def warm_node(node: NodeProcess, token: str) -> None:
    """One untimed create + delete straight on a new node: its first use of the template
    is not what the throughput run measures."""
    remote = RemoteRuntime(node.url, token)
    await remote.start()
    try:
        await direct_create(remote)
    finally:
        await remote.close()


def settle(cluster: Cluster) -> list[str]:
    """Bounded wait for the nodes' QEMUs to be gone after the kills."""
    deadline = time.monotonic() + SETTLE_S
    left = cluster.node_qemus()
    while left and time.monotonic() < deadline:
        time.sleep(0.5)
        left = cluster.node_qemus()
    return left


# -- report --------------------------------------------------------------------------------


def table(report: dict[str, Any]) -> str:
    cost, one, three = report["added_cost"], report["throughput_1"], report["throughput_3"]
    d, r = cost["direct"], cost["replica"]
    lines = [
        "",
        f"create (base, {CPU} vCPU, {MEMORY_MB} MB), sequential, n={d['n']}",
        f"  {'':28s} {'p50 ms':>9s} {'p99 ms':>9s} {'max ms':>9s}",
        f"  {'direct to node (RPC)':28s} {d['p50_ms']:9.1f} {d['p99_ms']:9.1f} {d['max_ms']:9.1f}",
        f"  {'through replica (SDK)':28s} {r['p50_ms']:9.1f} {r['p99_ms']:9.1f} {r['max_ms']:9.1f}",
        f"  {'replica / direct':28s} {cost['ratio_p50']:8.3f}x {cost['ratio_p99']:8.3f}x",
        f"  {'added by control plane':28s} {cost['added_ms_p50']:9.1f} {cost['added_ms_p99']:9.1f}",
        "",
        f"throughput: {one['count']} SDK creates, {one['concurrency']} concurrent",
        f"  {'':10s} {'creates/s':>10s} {'wall s':>8s} {'p50 ms':>9s} {'p99 ms':>9s}  spread",
    ]
    for t in (one, three):
        lat = t["latency"]
        lines.append(
            f"  {str(t['nodes']) + ' node(s)':10s} {t['creates_per_s']:10.3f} {t['wall_s']:8.1f} "
            f"{lat['p50_ms']:9.1f} {lat['p99_ms']:9.1f}  {t['spread']}"
        )
    lines.append(f"  3 nodes / 1 node: {report['throughput_ratio_3_over_1']:.3f}x")
    lines.append(f"  note: {report['note']}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=20, help="sequential creates per path")
    parser.add_argument("--concurrency", type=int, default=8, help="concurrent SDK creates")
    parser.add_argument("--count", type=int, default=24, help="creates per throughput run")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--logs", type=Path, default=None, help="keep the processes' logs here")
    args = parser.parse_args()
    before = HostState.now()
    failures: list[str] = []
    report: dict[str, Any] = {}
    with (
        tempfile.TemporaryDirectory(prefix="aenv-bench-cluster-") as tmp,
        TestResolver() as dns,
        EtcdCluster(Path(tmp) / "etcd") as etcd,
    ):
        root = Path(tmp)
        env = cluster_env(etcd.endpoints, secrets.token_urlsafe(16), f"/b{uuid.uuid4().hex[:8]}/")
        env["AGENTENV_DNS"] = dns.address  # guests resolve only at the bench's resolver
        cluster = Cluster(env, root)
        try:
            cluster.add_node(0)
            prepare_home(root / "control")
            cluster.server = replica(root / "control", env).start()
            cluster.wait_nodes(1)
            print(f"etcd {etcd.endpoints}; node-a {cluster.nodes[0].url}; "
                  f"replica {cluster.server.url}", flush=True)  # fmt: skip
            print(f"added cost per create, n={args.n}:", flush=True)
            report["added_cost"] = asyncio.run(added_cost(cluster, args.n))
            print(f"throughput, 1 node: {args.count} creates, {args.concurrency} at once",
                  flush=True)  # fmt: skip
            report["throughput_1"] = throughput(cluster, args.concurrency, args.count)
            if left := settle(cluster):
                failures.append(f"QEMUs still running after the 1-node kills: {left}")
            for i in (1, 2):
                node = cluster.add_node(i)
                cluster.wait_nodes(i + 1)
                asyncio.run(warm_node(node, cluster.token))
            print(f"throughput, 3 nodes: {args.count} creates, {args.concurrency} at once",
                  flush=True)  # fmt: skip
            report["throughput_3"] = throughput(cluster, args.concurrency, args.count)
            if left := settle(cluster):
                failures.append(f"QEMUs still running after the 3-node kills: {left}")
        except Exception:
            # The cluster misbehaved (a create failed, a node did not come up): the exact
            # error is the result; what was started is still stopped and checked below.
            failures.append(traceback.format_exc())
            failures += cluster.log_tails()
        finally:
            failures += [f"replica: {line}" for line in cluster.stale_deletes()]
            failures += cluster.stop()
            if left := cluster.node_qemus():
                failures.append(f"QEMUs left in the nodes' data dirs: {left}")
            if args.logs is not None:
                cluster.keep_logs(args.logs)
    for key in ("throughput_1", "throughput_3"):
        t = report.get(key, {})
        failures += [f"{key}: create failed: {e}" for e in t.get("errors", [])]
        failures += [f"{key}: kill failed: {e}" for e in t.get("kill_errors", [])]
    if "throughput_1" in report and "throughput_3" in report:
        one, three = (
            report["throughput_1"]["creates_per_s"],
            report["throughput_3"]["creates_per_s"],
        )
        report["throughput_ratio_3_over_1"] = round(three / one, 3) if one else float("nan")
        report["note"] = (
            f"{os.cpu_count()} cores, TCG guests: the nodes share the same CPUs, so 3 nodes "
            "are not 3x; the point is the number and that nothing fails"
        )
        report["host"] = {"cores": os.cpu_count()}
        print(table(report))
    else:
        print("partial results:", json.dumps(report, indent=2))
    return conclude(report, failures, before, args.json)


def conclude(
    report: dict[str, Any], failures: list[str], before: HostState, json_path: Path | None
) -> int:
    """A cluster bench's end (this one's and the benches built on its harness): what the run
    left on the host is a failure too; the report as JSON; the exit status."""
    failures += before.grown_since(HostState.now())
    report["failures"] = failures
    if json_path is not None:
        json_path.write_text(json.dumps(report, indent=2))
    if failures:
        print("\nFAILED:", *failures, sep="\n  ", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
