"""What a node's data gateway costs the data plane, on one machine, in one run.

Two node agents and one control-plane replica on a 3-member etcd: node-a runs its data
gateway (the default), node-b runs none (`AGENTENV_NODE_GATEWAY_BIND=off`: the replica dials
its guests' slot addresses, which only works on one host) — the baseline. One sandbox on
each (`base`, placed by cordoning the other node), then, alternating between the two so drift
on the host hits both alike:

1. **Small requests**: envd `GET /health` through the replica's proxy, one at a time over a
   keep-alive client: p50/p99 of each path, their ratio (gateway/direct) and the added ms.
2. **Concurrent requests**: T threads, each R requests: requests/s of each path and ratio.
3. **Bulk**: a file of M MiB read back through the SDK (`files.read`): MB/s of each path.

    flock /tmp/agentenv-vmtest.lock .venv/bin/python bench/gateway.py \
        [--n 300] [--threads 16] [--requests 40] [--mib 32] [--reads 5] [--json out.json]

Everything listens on loopback; guests' DNS is the bench's own resolver. Every process is
stopped (killed by PID on a hang); the run fails if a QEMU, network namespace or nft table is
left. Ratios, not timed assertions.
"""

from __future__ import annotations

import argparse
import os
import secrets
import sys
import tempfile
import time
import traceback
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
from clusterlib import bench_cluster  # first: it puts tests/ on the import path
from e2b import Sandbox

# isort: split
from cluster.etcd_cluster import EtcdCluster
from cluster_procs import NodeProcess, cluster_env, replica
from resolver import TestResolver

from agentenv.ports import ENVD_PORT
from agentenv.template.datadir import prepare_home

HostState = bench_cluster.HostState
Cluster = bench_cluster.Cluster
pct = bench_cluster.pct
summary = bench_cluster.summary
RT = bench_cluster.RT
PATHS = ("gateway", "direct")


def _api(cluster: Any) -> httpx.Client:
    srv = cluster.server
    return httpx.Client(
        base_url=srv.url, headers={"X-API-Key": srv.api_key}, timeout=60, trust_env=False
    )


def cordon(cluster: Any, node_id: str, on: bool) -> None:
    with _api(cluster) as api:
        resp = api.post(f"/nodes/{node_id}/{'cordon' if on else 'uncordon'}", json={})
        resp.raise_for_status()


def create_on(cluster: Any, node_id: str, other: str) -> Sandbox:
    """A `base` sandbox placed on `node_id` (the other node cordoned meanwhile)."""
    cordon(cluster, other, True)
    try:
        sbx = Sandbox.create(template="base", timeout=1200, request_timeout=RT,
                             **cluster.sdk_opts())  # fmt: skip
    finally:
        cordon(cluster, other, False)
    held = cluster.holder(sbx.sandbox_id)
    if held != node_id:
        sbx.kill(request_timeout=RT)
        raise RuntimeError(f"sandbox meant for {node_id} landed on {held}")
    return sbx


def health_client(cluster: Any, sandbox_id: str) -> httpx.Client:
    return httpx.Client(
        base_url=cluster.server.url,
        headers={"e2b-sandbox-id": sandbox_id, "e2b-sandbox-port": str(ENVD_PORT)},
        timeout=30,
        trust_env=False,
    )


def one_health(client: httpx.Client) -> float:
    t0 = time.perf_counter()
    resp = client.get("/health")
    took = time.perf_counter() - t0
    if resp.status_code >= 300:
        raise RuntimeError(f"/health through the proxy: {resp.status_code} {resp.text[:200]}")
    return took


def small_requests(cluster: Any, boxes: dict[str, Sandbox], n: int) -> dict[str, Any]:
    clients = {p: health_client(cluster, boxes[p].sandbox_id) for p in PATHS}
    took: dict[str, list[float]] = {p: [] for p in PATHS}
    try:
        for p in PATHS:  # untimed: first connections
            for _ in range(5):
                one_health(clients[p])
        for i in range(n):
            for p in PATHS if i % 2 == 0 else PATHS[::-1]:
                took[p].append(one_health(clients[p]))
    finally:
        for c in clients.values():
            c.close()
    g50, g99 = pct(took["gateway"], 0.5), pct(took["gateway"], 0.99)
    d50, d99 = pct(took["direct"], 0.5), pct(took["direct"], 0.99)
    return {
        "gateway": summary(took["gateway"]),
        "direct": summary(took["direct"]),
        "ratio_p50": round(g50 / d50, 3),
        "ratio_p99": round(g99 / d99, 3),
        "added_ms_p50": round((g50 - d50) * 1000, 2),
        "added_ms_p99": round((g99 - d99) * 1000, 2),
    }


def concurrent_requests(
    cluster: Any, boxes: dict[str, Sandbox], threads: int, requests: int
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for p in PATHS:

        def worker(_: int, sandbox_id: str = boxes[p].sandbox_id) -> list[float]:
            with health_client(cluster, sandbox_id) as client:
                return [one_health(client) for _ in range(requests)]

        t0 = time.perf_counter()
        with ThreadPoolExecutor(max_workers=threads) as pool:
            lat = [x for xs in pool.map(worker, range(threads)) for x in xs]
        wall = time.perf_counter() - t0
        out[p] = {"requests": len(lat), "wall_s": round(wall, 2),
                  "per_s": round(len(lat) / wall, 1), "latency": summary(lat)}  # fmt: skip
    out["ratio_per_s"] = round(out["gateway"]["per_s"] / out["direct"]["per_s"], 3)
    return out


def bulk(boxes: dict[str, Sandbox], mib: int, reads: int) -> dict[str, Any]:
    payload = os.urandom(mib * 1024 * 1024)
    for p in PATHS:
        boxes[p].files.write("/tmp/bulk.bin", payload, request_timeout=RT)
    took: dict[str, list[float]] = {p: [] for p in PATHS}
    for i in range(reads):
        for p in PATHS if i % 2 == 0 else PATHS[::-1]:
            t0 = time.perf_counter()
            got = boxes[p].files.read("/tmp/bulk.bin", format="bytes", request_timeout=RT)
            took[p].append(time.perf_counter() - t0)
            if bytes(got) != payload:
                raise RuntimeError(f"{p}: the file came back different")
    rate = {p: round(mib * 1.048576 / pct(took[p], 0.5), 1) for p in PATHS}
    return {"mib": mib, "reads": reads, "mb_per_s_p50": rate,
            "ratio": round(rate["gateway"] / rate["direct"], 3)}  # fmt: skip


def table(report: dict[str, Any]) -> str:
    s, c, b = report["small"], report["concurrent"], report["bulk"]
    lines = [
        "",
        f"envd GET /health through the replica, sequential, n={s['gateway']['n']} per path",
        f"  {'':24s} {'p50 ms':>8s} {'p99 ms':>8s} {'max ms':>8s}",
    ]
    for p in PATHS:
        r = s[p]
        lines.append(f"  {p:24s} {r['p50_ms']:8.2f} {r['p99_ms']:8.2f} {r['max_ms']:8.2f}")
    lines += [
        f"  {'gateway / direct':24s} {s['ratio_p50']:7.3f}x {s['ratio_p99']:7.3f}x",
        f"  {'added by the gateway':24s} {s['added_ms_p50']:8.2f} {s['added_ms_p99']:8.2f}",
        "",
        f"concurrent: {c['gateway']['requests']} requests per path",
    ]
    for p in PATHS:
        r = c[p]
        lines.append(f"  {p:24s} {r['per_s']:8.1f} req/s  p99 {r['latency']['p99_ms']:.1f} ms")
    lines += [
        f"  {'gateway / direct':24s} {c['ratio_per_s']:7.3f}x",
        "",
        f"bulk: {b['mib']} MiB read {b['reads']}x per path (SDK files.read)",
    ]
    for p in PATHS:
        lines.append(f"  {p:24s} {b['mb_per_s_p50'][p]:8.1f} MB/s")
    lines.append(f"  {'gateway / direct':24s} {b['ratio']:7.3f}x")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=300, help="sequential requests per path")
    parser.add_argument("--threads", type=int, default=16)
    parser.add_argument("--requests", type=int, default=40, help="per thread")
    parser.add_argument("--mib", type=int, default=32)
    parser.add_argument("--reads", type=int, default=5)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    before = HostState.now()
    failures: list[str] = []
    report: dict[str, Any] = {}
    with (
        tempfile.TemporaryDirectory(prefix="aenv-bench-gateway-") as tmp,
        TestResolver() as dns,
        EtcdCluster(Path(tmp) / "etcd") as etcd,
    ):
        root = Path(tmp)
        env = cluster_env(etcd.endpoints, secrets.token_urlsafe(16), f"/g{uuid.uuid4().hex[:8]}/")
        env["AGENTENV_DNS"] = dns.address
        cluster = Cluster(env, root)
        boxes: dict[str, Sandbox] = {}
        try:
            a = NodeProcess(root / "node-a", "node-a", bench_cluster.SLOT_CIDRS[0], env)
            b = NodeProcess(root / "node-b", "node-b", bench_cluster.SLOT_CIDRS[1],
                            {**env, "AGENTENV_NODE_GATEWAY_BIND": "off"})  # fmt: skip
            for node in (a, b):
                cluster.nodes.append(node)
                node.start()
            prepare_home(root / "control")
            cluster.server = replica(root / "control", env).start()
            cluster.wait_nodes(2)
            boxes["gateway"] = create_on(cluster, "node-a", "node-b")
            boxes["direct"] = create_on(cluster, "node-b", "node-a")
            print(f"gateway path: {boxes['gateway'].sandbox_id} on node-a; "
                  f"direct path: {boxes['direct'].sandbox_id} on node-b", flush=True)  # fmt: skip
            report["small"] = small_requests(cluster, boxes, args.n)
            print("small requests done", flush=True)
            report["concurrent"] = concurrent_requests(cluster, boxes, args.threads, args.requests)
            print("concurrent requests done", flush=True)
            report["bulk"] = bulk(boxes, args.mib, args.reads)
            with _api(cluster) as api:
                metrics = api.get("/metrics").text
            report["tunnels"] = [
                line for line in metrics.splitlines()
                if line.startswith("agentenv_proxy_tunnels_total{")
            ]  # fmt: skip
            if len(report["tunnels"]) != 1:
                failures.append(f"expected tunnels to node-a's gateway only: {report['tunnels']}")
            print(table(report))
        except Exception:
            failures.append(traceback.format_exc())
            failures += cluster.log_tails()
        finally:
            for sbx in boxes.values():
                try:
                    sbx.kill(request_timeout=RT)
                except Exception as exc:
                    failures.append(f"kill {sbx.sandbox_id}: {exc}")
            if left := bench_cluster.settle(cluster):
                failures.append(f"QEMUs still running after the kills: {left}")
            failures += cluster.stop()
            if left := cluster.node_qemus():
                failures.append(f"QEMUs left in the nodes' data dirs: {left}")
    report["host"] = {"cores": os.cpu_count()}
    return bench_cluster.conclude(report, failures, before, args.json)


if __name__ == "__main__":
    sys.exit(main())
