"""Control-plane and proxy benchmark through the official E2B SDK, in one run:

1. create → `commands.run("echo hi")` → kill round trips (p50 / p99 / max), one at a time;
2. proxy overhead: the same GET to an HTTP server inside one sandbox, through the server's
   proxy (header routing) and directly to the sandbox's slot address, both over keep-alive
   connections; prints the median of each and their ratio (small and 1 MiB bodies).

    .venv/bin/python bench/api.py [-n 5] [--requests 200]

The server is started as a child process on a free loopback port with its own data dir.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

import httpx
from e2b import Sandbox

from agentenv.api.devserver import ServerProcess
from agentenv.control.sqlite_store import SqliteStore
from agentenv.control.store import SandboxRecord
from agentenv.template.datadir import prepare_home

GUEST_PORT = 8080


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


def round_trips(opts: dict[str, str], n: int) -> list[float]:
    times = []
    for i in range(n):
        t0 = time.perf_counter()
        sbx = Sandbox.create(template="base", timeout=120, request_timeout=300, **opts)  # type: ignore[arg-type]
        out = sbx.commands.run("echo hi").stdout
        sbx.kill()
        times.append(time.perf_counter() - t0)
        assert out == "hi\n", out
        print(f"  round trip {i + 1}/{n}: {times[-1]:.2f} s", flush=True)
    return times


def timed_gets(client: httpx.Client, url: str, headers: dict[str, str], n: int) -> list[float]:
    client.get(url, headers=headers).raise_for_status()  # warm the connection
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        resp = client.get(url, headers=headers)
        times.append(time.perf_counter() - t0)
        resp.raise_for_status()
    return times


async def _row(db: Path, sandbox_id: str) -> SandboxRecord | None:
    """The server's row of a sandbox (its own connection to the server's SQLite file)."""
    store = SqliteStore(db)
    try:
        return await store.get(sandbox_id)
    finally:
        await store.close()


def proxy_overhead(server: ServerProcess, opts: dict[str, str], n: int) -> dict[str, float]:
    sbx = Sandbox.create(template="base", timeout=600, request_timeout=300, **opts)  # type: ignore[arg-type]
    try:
        rec = asyncio.run(_row(server.home / "agentenv.db", sbx.sandbox_id))
        assert rec is not None and rec.address
        www = f"/tmp/aenv-bench-{sbx.sandbox_id}"
        sbx.commands.run(f"mkdir -p {www} && echo hi > {www}/small && "
                         f"head -c 1048576 /dev/urandom > {www}/big")  # fmt: skip
        sbx.commands.run(
            f"python3 -m http.server {GUEST_PORT} --directory {www}",
            background=True,
            timeout=0,
        )
        routing = {"e2b-sandbox-id": sbx.sandbox_id, "e2b-sandbox-port": str(GUEST_PORT)}
        results: dict[str, float] = {}
        with httpx.Client(timeout=60, trust_env=False) as client:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                try:
                    if client.get(f"http://{rec.address}:{GUEST_PORT}/small").status_code == 200:
                        break
                except httpx.TransportError:
                    time.sleep(0.2)
            for name, reqs in (("small", n), ("big", max(10, n // 10))):
                direct = timed_gets(client, f"http://{rec.address}:{GUEST_PORT}/{name}", {}, reqs)
                proxied = timed_gets(client, f"{server.url}/{name}", routing, reqs)
                d, p = statistics.median(direct), statistics.median(proxied)
                results[f"{name}_direct_ms"] = round(d * 1000, 2)
                results[f"{name}_proxy_ms"] = round(p * 1000, 2)
                results[f"{name}_ratio"] = round(p / d, 2)
        sbx.commands.run(f"rm -rf {www}")
        return results
    finally:
        sbx.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("-n", type=int, default=5, help="create→run→kill round trips")
    parser.add_argument("--requests", type=int, default=200, help="GETs per proxy measurement")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="aenv-bench-") as tmp:
        home = prepare_home(Path(tmp))
        with ServerProcess(home, ready_timeout_s=180) as server:
            opts = {"api_key": server.api_key, "api_url": server.url, "sandbox_url": server.url}
            print(f"server {server.url}", flush=True)
            trips = round_trips(opts, args.n)
            overhead = proxy_overhead(server, opts, args.requests)
    report = {
        "round_trip_s": {
            "n": len(trips),
            "p50": round(statistics.median(trips), 2),
            "p99": round(pct(trips, 0.99), 2),
            "max": round(max(trips), 2),
        },
        "proxy": overhead,
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
