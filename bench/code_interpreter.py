"""Code-interpreter round trip next to a plain command, on one sandbox, in one run.

    .venv/bin/python bench/code_interpreter.py [-n 200] [--api-url URL --api-key KEY]

On one `code-interpreter-v1` sandbox made by the official `e2b-code-interpreter` SDK:
`run_code("1+1")` (POST :49999/execute through the proxy, the guest's server, a Jupyter
kernel, NDJSON back) and `commands.run("true")` (envd's Start stream through the same proxy),
n of each, interleaved so both see the same machine. Prints p50/p99/max of each in ms and the
ratio of run_code's p50 (and p99) to the command's: the command is the baseline.

Without --api-url a server is started as a child process on a free loopback port with its own
data dir; a node builds `code-interpreter-v1` on its first create (a minute or two under TCG,
answered 503 + Retry-After meanwhile), which this waits out up to --build-timeout. Exits 2
with a "template missing" message when the template is not there: no
`agentenv.template.code_interpreter` in this checkout (own server), or the server answers
that it has no such template.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

TEMPLATE = "code-interpreter-v1"
# What a create may take once the template exists (a resume under TCG on a busy machine).
CREATE_TIMEOUT_S = 300.0


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


def missing(why: str) -> None:
    print(f"template missing: {why}", file=sys.stderr)
    raise SystemExit(2)


def create(opts: dict[str, Any], build_timeout_s: float) -> Any:
    """A code-interpreter sandbox, once the server has the template (building it on demand
    answers 503 until it is registered; anything naming an unknown template is fatal)."""
    from e2b.exceptions import NotFoundException
    from e2b_code_interpreter import Sandbox

    deadline = time.monotonic() + build_timeout_s
    while True:
        try:
            return Sandbox.create(
                template=TEMPLATE, timeout=600, request_timeout=CREATE_TIMEOUT_S, **opts
            )
        except NotFoundException as exc:
            missing(f"the server has no {TEMPLATE} template ({exc})")
        except Exception as exc:
            text = str(exc)
            if "404" in text or "not found" in text.lower():
                missing(f"the server has no {TEMPLATE} template ({text})")
            if "503" not in text and "Retry" not in text and "build" not in text.lower():
                raise
            if time.monotonic() > deadline:
                raise SystemExit(
                    f"{TEMPLATE} still not built after {build_timeout_s:.0f} s: {text}"
                ) from None
            print(f"  waiting for the template build: {text[:160]}", flush=True)
            time.sleep(10)


def timed(fn: Callable[[], None]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def measure(sbx: Any, n: int) -> dict[str, Any]:
    def run_code() -> None:
        execution = sbx.run_code("1+1")
        if execution.error is not None or execution.text != "2":
            raise SystemExit(f"run_code('1+1') answered {execution!r}")

    def command() -> None:
        result = sbx.commands.run("true")
        if result.exit_code != 0:
            raise SystemExit(f"commands.run('true') answered {result!r}")

    # Warm-up: the kernel's first execute, the connection pools.
    for _ in range(3):
        run_code()
        command()
    code_s: list[float] = []
    cmd_s: list[float] = []
    for i in range(n):
        code_s.append(timed(run_code))
        cmd_s.append(timed(command))
        if (i + 1) % 50 == 0:
            print(f"  {i + 1}/{n}", flush=True)

    def summary(xs: list[float]) -> dict[str, float]:
        return {
            "p50_ms": round(statistics.median(xs) * 1000, 2),
            "p99_ms": round(pct(xs, 0.99) * 1000, 2),
            "max_ms": round(max(xs) * 1000, 2),
        }

    code, cmd = summary(code_s), summary(cmd_s)
    return {
        "n": n,
        "run_code_1plus1": code,
        "commands_run_true": cmd,
        "ratio_p50": round(code["p50_ms"] / cmd["p50_ms"], 2),
        "ratio_p99": round(code["p99_ms"] / cmd["p99_ms"], 2),
    }


def bench(opts: dict[str, Any], n: int, build_timeout_s: float) -> dict[str, Any]:
    t0 = time.perf_counter()
    sbx = create(opts, build_timeout_s)
    created_s = time.perf_counter() - t0
    try:
        report = measure(sbx, n)
    finally:
        sbx.kill()
    report["first_create_s"] = round(created_s, 2)
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("-n", type=int, default=200, help="round trips of each kind")
    parser.add_argument("--api-url", help="an existing server (else one is started)")
    parser.add_argument("--api-key", help="its API key (with --api-url)")
    parser.add_argument(
        "--build-timeout", type=float, default=900, help="seconds to wait for the template build"
    )
    args = parser.parse_args()
    if importlib.util.find_spec("e2b_code_interpreter") is None:
        raise SystemExit("e2b-code-interpreter is not installed (the dev extras have it)")
    if args.api_url:
        if not args.api_key:
            raise SystemExit("--api-url needs --api-key")
        opts = {"api_key": args.api_key, "api_url": args.api_url, "sandbox_url": args.api_url}
        report = bench(opts, args.n, args.build_timeout)
    else:
        if importlib.util.find_spec("agentenv.template.code_interpreter") is None:
            missing("agentenv.template.code_interpreter is not in this checkout yet")
        from agentenv.api.devserver import ServerProcess
        from agentenv.template.datadir import prepare_home

        with tempfile.TemporaryDirectory(prefix="aenv-bench-ci-") as tmp:
            home = prepare_home(Path(tmp))
            with ServerProcess(home, ready_timeout_s=180) as server:
                print(f"server {server.url}", flush=True)
                opts = {"api_key": server.api_key, "api_url": server.url, "sandbox_url": server.url}
                report = bench(opts, args.n, args.build_timeout)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
