"""What a domain policy costs a guest: HTTP requests to a host of a bench-made "internet"
(a network namespace, TEST-NET-2 addresses, a name the bench's own resolver answers), from a
sandbox with an open policy (the baseline, measured in the same run) and from one whose
policy allows only that name (every connection goes through the slot's inspecting proxy and
every lookup through its DNS forwarder). Requests are timed inside the guest, one new
connection each, so the proxy's accept + peek + connect is in every sample.

    .venv/bin/python bench/egress.py [--requests 200]

Prints per-request p50/p99 for both and the ratio inspected/open.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from e2b import ALL_TRAFFIC, Sandbox

from agentenv.api.devserver import ServerProcess
from agentenv.template.datadir import prepare_home

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from resolver import TestResolver

NETNS, HOST_END, INET_END = "aeb-inet", "aeb-i0", "aeb-i1"
HOST_IP, INET_IP = "198.51.100.5", "198.51.100.6"
NAME = "web.test"

GUEST_LOOP = """
import json, time, urllib.request
t = []
for _ in range({n}):
    s = time.monotonic()
    urllib.request.urlopen("http://{name}/hello.txt", timeout=10).read()
    t.append(time.monotonic() - s)
print(json.dumps(t))
"""


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


@contextlib.contextmanager
def internet(root: Path) -> Iterator[None]:
    (root / "hello.txt").write_text("hello\n")
    _ip("netns", "add", NETNS)
    server = None
    try:
        _ip("link", "add", HOST_END, "type", "veth", "peer", "name", INET_END, "netns", NETNS)
        _ip("addr", "add", f"{HOST_IP}/30", "dev", HOST_END)
        _ip("link", "set", HOST_END, "up")
        _ip("-n", NETNS, "addr", "add", f"{INET_IP}/30", "dev", INET_END)
        _ip("-n", NETNS, "link", "set", INET_END, "up")
        _ip("-n", NETNS, "route", "add", "198.18.0.0/15", "via", HOST_IP)
        server = subprocess.Popen(
            [
                *("ip", "netns", "exec", NETNS, sys.executable, "-m", "http.server", "80"),
                *("--bind", INET_IP),
            ],
            cwd=root,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        time.sleep(1.0)
        yield
    finally:
        if server is not None:
            server.kill()
            server.wait()
        with contextlib.suppress(subprocess.CalledProcessError):
            _ip("link", "del", HOST_END)
        _ip("netns", "del", NETNS)


def measure(sbx: Sandbox, n: int) -> list[float]:
    out = sbx.commands.run(f"python3 -c '{GUEST_LOOP.format(n=n, name=NAME)}'", timeout=600).stdout
    return [float(x) for x in json.loads(out)]


def summary(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {
        "p50_ms": round(statistics.median(ordered) * 1000, 2),
        "p99_ms": round(ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))] * 1000, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=200)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, TestResolver({NAME: [INET_IP]}) as dns:
        root = Path(tmp)
        home = prepare_home(root / "home")
        env = {"AGENTENV_DNS": dns.address}
        with internet(root), ServerProcess(home, env=env, ready_timeout_s=300) as srv:
            opts = {"api_key": srv.api_key, "api_url": srv.url, "sandbox_url": srv.url}
            open_ = Sandbox.create(timeout=900, **opts)  # type: ignore[arg-type]
            named = Sandbox.create(
                timeout=900,
                network={"allow_out": [NAME], "deny_out": [ALL_TRAFFIC]},
                **opts,  # type: ignore[arg-type]
            )
            try:
                measure(open_, 5)
                measure(named, 5)
                base = summary(measure(open_, args.requests))
                inspected = summary(measure(named, args.requests))
            finally:
                open_.kill()
                named.kill()
    result = {
        "requests": args.requests,
        "open": base,
        "domain_policy": inspected,
        "ratio_p50": round(inspected["p50_ms"] / base["p50_ms"], 2),
        "ratio_p99": round(inspected["p99_ms"] / base["p99_ms"], 2),
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
