"""envd micro-benchmark: exec round trip and output stream throughput.

    python bench/envd.py [--url http://HOST:49983] [--runs 50] [--mb 200]

Without --url it starts envd on a free loopback port. Prints the p50/p99 latency of Start of
`/bin/true` until its end event, the same for the SDK's `bash -l -c true`, the baseline
`subprocess.run(["true"])` in this process and the ratio, then the MB/s of a command's stdout
streamed through envd.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import socket
import statistics
import subprocess
import sys
import time
from typing import Any

import httpx

from agentenv.guest.envd.client import EnvdClient, encode_envelope, iter_envelopes

HEADERS = {"content-type": "application/connect+json", "connect-protocol-version": "1"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _pct(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def _start(http: httpx.AsyncClient, process: dict[str, Any]) -> int:
    """Runs one Start stream to its end; returns the stdout bytes received."""
    received = 0
    body = encode_envelope({"process": process, "stdin": False})
    async with http.stream("POST", "/process.Process/Start", content=body, headers=HEADERS) as r:
        r.raise_for_status()
        async for flags, payload in iter_envelopes(r.aiter_raw()):
            if flags & 2:
                continue  # end of stream; read on so the connection can be reused
            event = json.loads(payload).get("event", {})
            if "data" in event and "stdout" in event["data"]:
                received += len(base64.b64decode(event["data"]["stdout"]))
    return received


async def _latency(http: httpx.AsyncClient, process: dict[str, Any], runs: int) -> list[float]:
    await _start(http, process)  # warm-up
    samples = []
    for _ in range(runs):
        started = time.perf_counter()
        await _start(http, process)
        samples.append(time.perf_counter() - started)
    return samples


def _baseline(runs: int) -> list[float]:
    samples = []
    for _ in range(runs):
        started = time.perf_counter()
        subprocess.run(["true"], check=True)
        samples.append(time.perf_counter() - started)
    return samples


async def bench(url: str, runs: int, megabytes: int) -> None:
    async with EnvdClient(url) as client:
        await client.wait_healthy(60)
    async with httpx.AsyncClient(base_url=url, timeout=600) as http:
        direct = await _latency(http, {"cmd": "/bin/true"}, runs)
        shell = await _latency(http, {"cmd": "/bin/bash", "args": ["-l", "-c", "true"]}, runs)
        base = _baseline(runs)
        size = megabytes * 1_000_000
        started = time.perf_counter()
        got = await _start(http, {"cmd": "/bin/sh", "args": ["-c", f"head -c {size} /dev/zero"]})
        elapsed = time.perf_counter() - started
    assert got == size, f"received {got} of {size} bytes"
    rows = [
        (f"envd exec round trip (/bin/true, {runs} runs)", direct),
        ("envd exec round trip (bash -l -c true)", shell),
        ("baseline subprocess.run(['true'])", base),
    ]
    for label, samples in rows:
        p50, p99 = _pct(samples, 0.5) * 1e3, _pct(samples, 0.99) * 1e3
        print(f"{label:<44} p50 {p50:7.1f} ms  p99 {p99:7.1f} ms")
    ratio50 = _pct(direct, 0.5) / _pct(base, 0.5)
    ratio99 = _pct(direct, 0.99) / _pct(base, 0.99)
    print(f"{'ratio envd /bin/true vs baseline':<44} p50 {ratio50:7.1f}x    p99 {ratio99:7.1f}x")
    rate = size / elapsed / 1e6
    label = "stream throughput (stdout through envd)"
    print(f"{label:<44} {megabytes} MB in {elapsed:.2f} s = {rate:.0f} MB/s")
    print(f"{'mean /bin/true round trip':<44} {statistics.mean(direct) * 1e3:.1f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--url", help="an envd that is already running")
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--mb", type=int, default=200, help="megabytes to stream")
    args = parser.parse_args()
    proc = None
    url = args.url
    if url is None:
        port = _free_port()
        envd = ["-m", "agentenv.guest.envd", "--host", "127.0.0.1", "--port", str(port)]
        proc = subprocess.Popen(
            [sys.executable, *envd, "--default-user", "root", "--log-level", "warning"]
        )
        url = f"http://127.0.0.1:{port}"
    try:
        asyncio.run(bench(url, args.runs, args.mb))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(15)


if __name__ == "__main__":
    main()
