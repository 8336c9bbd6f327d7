"""Load benchmark through the official E2B SDK (threads) against a server process, in one run:

1. creates/s and create p50/p99 at concurrency 1, 4, 16, 64: each of C worker threads loops
   create → `commands.run("true")` 3 times (the exec round trip under that load, p50/p99) → kill;
   next to a baseline at the same concurrency measured in the same run: a plain
   `unshare --net --pid --fork true` process start, and `bwrap` (package bubblewrap,
   installed if missing unless --no-install) with a new network namespace;
2. host CPU per sandbox (server + its QEMUs and helpers, from /proc: the server's own and
   reaped children's times plus live QEMUs') and the host's busy share of its cores, and
   memory (PSS from smaps_rollup) per live sandbox, sampled while the level runs;
3. fork of 8 and 32 children (`POST /sandboxes/{id}/fork`) against the same number of single
   creates from a snapshot of the same sandbox, one after another.

Creates the server refuses with 503 (admission control) are retried by the SDK honouring
Retry-After (bounded, `retries`), counted separately, and given up after that.

    .venv/bin/python bench/load.py [--max-concurrency 64] [--rounds 2] [--forks 8,32]

The knee is the concurrency after which creates/s stops growing (less than 10% more).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import itertools
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from e2b import Sandbox, ServiceBusyException
from e2b import retry as e2b_retry

from agentenv.api.devserver import ServerProcess
from agentenv.template.datadir import prepare_home
from agentenv.vmm import registry

LEVELS = (1, 4, 16, 64)
EXECS = 3
MIN_CREATES = 12
# SDK retries of a 503 (each waits Retry-After); then the create counts as refused.
BUSY_RETRIES = 8
BASELINE_RUNS = 4  # process starts per worker thread, per baseline
TICK = os.sysconf("SC_CLK_TCK")
KNEE_GAIN = 1.10


def pct(xs: Sequence[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


# -- 503 accounting: the SDK's own retry hook sees every retried response ------------------

_busy_lock = threading.Lock()
_busy_seen = 0


def _install_busy_counter() -> None:
    original = e2b_retry._retry_delay

    def counting(response: httpx.Response, attempt: int, random_: Callable[[], float]) -> Any:
        global _busy_seen
        if response.status_code == 503:
            with _busy_lock:
                _busy_seen += 1
        return original(response, attempt, random_)

    e2b_retry._retry_delay = counting


def busy_seen() -> int:
    with _busy_lock:
        return _busy_seen


# -- /proc readings ---------------------------------------------------------------------------


def _stat_times(pid: int, children: bool) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    # After the comm: state is fields[0]; utime, stime, cutime, cstime are 14-17 (1-based).
    ticks = int(fields[11]) + int(fields[12])
    if children:
        ticks += int(fields[13]) + int(fields[14])
    return ticks / TICK


def sandbox_qemus(home: Path) -> dict[int, bool]:
    """QEMUs of this data dir: pid → whether it runs a sandbox (not a warm entry/converter)."""
    out: dict[int, bool] = {}
    warm = str(home / "warm") + "/"
    for pid, cmd in registry.qemu_processes(str(home)).items():
        out[pid] = warm not in cmd and "/convert/" not in cmd
    return out


def server_cpu_s(server: ServerProcess) -> float:
    """CPU seconds of the server, of its reaped children (QEMUs, helpers) and of its live
    QEMUs; a QEMU alive at both readings is counted live both times, one that ended in
    between moves into the server's children times when it is reaped."""
    assert server.proc is not None
    total = _stat_times(server.proc.pid, children=True)
    for pid in sandbox_qemus(server.home):
        with contextlib.suppress(OSError, IndexError):  # it ended meanwhile
            total += _stat_times(pid, children=False)
    return total


def host_busy() -> tuple[float, float]:
    """(busy, total) jiffies of all CPUs from /proc/stat."""
    vals = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = vals[3] + vals[4]
    total = sum(vals[:8])
    return float(total - idle), float(total)


def pss_kb(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


class PssSampler:
    """Every `every_s`, the mean PSS of the live sandbox QEMUs (while any run)."""

    def __init__(self, home: Path, every_s: float = 2.0) -> None:
        self.home, self.every_s = home, every_s
        self.per_sandbox_mb: list[float] = []
        self.live: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            pids = [p for p, sandbox in sandbox_qemus(self.home).items() if sandbox]
            values = [v for v in (pss_kb(p) for p in pids) if v > 0]
            if values:
                self.per_sandbox_mb.append(statistics.fmean(values) / 1024)
                self.live.append(len(values))

    def __enter__(self) -> PssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


# -- one load level ---------------------------------------------------------------------------


@dataclass
class Level:
    concurrency: int
    creates: int = 0
    refused: int = 0  # gave up after BUSY_RETRIES 503s
    busy: int = 0  # 503 answers seen (each retried)
    errors: list[str] = field(default_factory=list)
    create_s: list[float] = field(default_factory=list)
    exec_s: list[float] = field(default_factory=list)
    wall_s: float = 0.0
    cpu_s: float = 0.0
    host_busy_pct: float = 0.0
    pss_mb: float = float("nan")
    peak_live: int = 0
    base_starts_s: dict[str, float] = field(default_factory=dict)  # baseline → starts/s
    base_p50_ms: dict[str, float] = field(default_factory=dict)
    base_p99_ms: dict[str, float] = field(default_factory=dict)

    @property
    def creates_per_s(self) -> float:
        return self.creates / self.wall_s if self.wall_s else 0.0


def run_level(server: ServerProcess, opts: dict[str, Any], c: int, total: int) -> Level:
    lv = Level(c)
    lock = threading.Lock()
    next_i = iter(range(total))

    def worker() -> None:
        while True:
            with lock:
                if next(next_i, None) is None:
                    return
            t0 = time.perf_counter()
            try:
                s = Sandbox.create(template="base", timeout=600, request_timeout=300, **opts)
            except ServiceBusyException:
                with lock:
                    lv.refused += 1
                continue
            except Exception as exc:
                with lock:
                    lv.errors.append(f"create: {type(exc).__name__}: {exc}")
                continue
            dt = time.perf_counter() - t0
            execs = []
            try:
                for _ in range(EXECS):
                    t1 = time.perf_counter()
                    s.commands.run("true")
                    execs.append(time.perf_counter() - t1)
            except Exception as exc:
                with lock:
                    lv.errors.append(f"exec: {type(exc).__name__}: {exc}")
            finally:
                try:
                    s.kill()
                except Exception as exc:
                    with lock:
                        lv.errors.append(f"kill: {type(exc).__name__}: {exc}")
            with lock:
                lv.creates += 1
                lv.create_s.append(dt)
                lv.exec_s.extend(execs)

    busy0, cpu0, (hb0, ht0) = busy_seen(), server_cpu_s(server), host_busy()
    t0 = time.monotonic()
    with PssSampler(server.home) as pss:
        threads = [threading.Thread(target=worker) for _ in range(c)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    lv.wall_s = time.monotonic() - t0
    hb1, ht1 = host_busy()
    lv.cpu_s = server_cpu_s(server) - cpu0
    lv.host_busy_pct = 100.0 * (hb1 - hb0) / max(1.0, ht1 - ht0)
    lv.busy = busy_seen() - busy0
    if pss.per_sandbox_mb:
        lv.pss_mb = statistics.fmean(pss.per_sandbox_mb)
        lv.peak_live = max(pss.live)
    return lv


# -- baseline: a bare process start in new namespaces ----------------------------------------


def baseline_commands(install: bool) -> dict[str, list[str]]:
    cmds = {"unshare": ["unshare", "--net", "--pid", "--fork", "true"]}
    if shutil.which("bwrap") is None and install and os.geteuid() == 0:
        print("installing bubblewrap (apt-get) for the baseline", flush=True)
        subprocess.run(
            ["apt-get", "install", "-y", "-qq", "bubblewrap"],
            env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"},
            stdout=subprocess.DEVNULL,
            check=False,
            timeout=600,
        )
    if shutil.which("bwrap"):
        cmds["bwrap"] = [
            "bwrap", "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc",
            "--unshare-net", "--unshare-pid", "--die-with-parent", "true",
        ]  # fmt: skip
    return cmds


def baseline(cmd: list[str], c: int) -> tuple[float, float, float]:
    """(starts/s, p50 ms, p99 ms) of `cmd` run by `c` threads, BASELINE_RUNS each."""
    times: list[float] = []
    lock = threading.Lock()

    def worker() -> None:
        for _ in range(BASELINE_RUNS):
            t0 = time.perf_counter()
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, timeout=60)
            with lock:
                times.append(time.perf_counter() - t0)

    t0 = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(c) as pool:
        for f in [pool.submit(worker) for _ in range(c)]:
            f.result()
    wall = time.monotonic() - t0
    return len(times) / wall, pct(times, 0.5) * 1000, pct(times, 0.99) * 1000


# -- memory of idle sandboxes --------------------------------------------------------------


@dataclass
class IdleMemory:
    n: int
    pss_mb: list[float]
    server_pss_mb: float
    server_pss_empty_mb: float
    cpu_pct: float  # server + QEMUs while the n sandboxes idle, % of one core


def idle_memory(server: ServerProcess, opts: dict[str, Any], n: int) -> IdleMemory:
    """PSS of `n` idle sandboxes' QEMUs (created concurrently, then left alone for a few
    seconds) and of the server with and without them."""
    assert server.proc is not None
    empty = pss_kb(server.proc.pid) / 1024
    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        boxes = list(
            pool.map(
                lambda _: Sandbox.create(template="base", timeout=600, request_timeout=300, **opts),
                range(n),
            )
        )
    try:
        for s in boxes:
            s.commands.run("true")
        time.sleep(5.0)
        cpu0, t0 = server_cpu_s(server), time.monotonic()
        time.sleep(5.0)
        cpu = 100.0 * (server_cpu_s(server) - cpu0) / (time.monotonic() - t0)
        pids = [p for p, sandbox in sandbox_qemus(server.home).items() if sandbox]
        values = [pss_kb(p) / 1024 for p in pids]
        full = pss_kb(server.proc.pid) / 1024
    finally:
        with concurrent.futures.ThreadPoolExecutor(n) as pool:
            list(pool.map(lambda s: s.kill(), boxes))
    return IdleMemory(n, values, full, empty, cpu)


# -- fork vs single creates -------------------------------------------------------------------


@dataclass
class ForkRow:
    n: int
    fork_s: float
    singles_s: float
    busy: int
    note: str = ""


def fork_vs_singles(
    server: ServerProcess, opts: dict[str, Any], counts: Sequence[int]
) -> list[ForkRow]:
    rows = []
    api = httpx.Client(
        base_url=server.url, headers={"X-API-Key": server.api_key}, timeout=900, trust_env=False
    )
    parent = Sandbox.create(template="base", timeout=1800, request_timeout=300, **opts)
    try:
        parent.files.write("/home/user/parent", "p")
        snap = parent.create_snapshot()
        for n in counts:
            busy0 = busy_seen()
            t0 = time.monotonic()
            resp = api.post(
                f"/sandboxes/{parent.sandbox_id}/fork", json={"count": n, "timeout": 600}
            )
            fork_s = time.monotonic() - t0
            note = "" if resp.status_code == 201 else f"fork answered {resp.status_code}"
            kids = (
                [k["sandbox"]["sandboxID"] for k in resp.json()] if resp.status_code == 201 else []
            )
            for kid in kids:
                api.delete(f"/sandboxes/{kid}")
            singles: list[Sandbox] = []
            t0 = time.monotonic()
            try:
                for _ in range(n):
                    singles.append(
                        Sandbox.create(snap.snapshot_id, timeout=600, request_timeout=300, **opts)
                    )
                singles_s = time.monotonic() - t0
            except ServiceBusyException:
                singles_s = float("nan")
                note += f" singles refused after {len(singles)}"
            finally:
                for s in singles:
                    s.kill()
            rows.append(ForkRow(n, fork_s, singles_s, busy_seen() - busy0, note.strip()))
            print(f"  fork {n}: {fork_s:.2f}s, {n} single creates {singles_s:.2f}s", flush=True)
        Sandbox.delete_snapshot(snap.snapshot_id, **opts)
    finally:
        parent.kill()
        api.close()
    return rows


# -- report -----------------------------------------------------------------------------------


def knee(levels: Sequence[Level]) -> Level | None:
    """The last level whose creates/s the next level does not beat by KNEE_GAIN."""
    for a, b in itertools.pairwise(levels):
        if b.creates_per_s < a.creates_per_s * KNEE_GAIN:
            return a
    return None


def report(
    levels: Sequence[Level],
    forks: Sequence[ForkRow],
    idle: IdleMemory | None,
    cores: int,
    max_starts: str,
) -> None:
    names = sorted({k for lv in levels for k in lv.base_starts_s})
    head = (
        f"{'conc':>4} {'creates':>7} {'503s':>5} {'refused':>7} {'creates/s':>9} "
        f"{'create p50':>10} {'p99':>6} {'exec p50':>8} {'p99':>6} {'cpu-s/sbx':>9} "
        f"{'host busy':>9} {'PSS/sbx':>8} {'live':>4}"
    )
    head += "".join(f" {n + ' starts/s':>16} {'p50':>6} {'p99':>6}" for n in names)
    print(head)
    for lv in levels:
        line = (
            f"{lv.concurrency:>4} {lv.creates:>7} {lv.busy:>5} {lv.refused:>7} "
            f"{lv.creates_per_s:>9.2f} {pct(lv.create_s, 0.5):>9.2f}s "
            f"{pct(lv.create_s, 0.99):>5.2f}s "
            f"{pct(lv.exec_s, 0.5) * 1000:>6.0f}ms {pct(lv.exec_s, 0.99) * 1000:>4.0f}ms "
            f"{lv.cpu_s / max(1, lv.creates):>9.2f} {lv.host_busy_pct:>8.0f}% "
            f"{lv.pss_mb:>6.1f}MB {lv.peak_live:>4}".replace("nanMB", "    -")
        )
        line += "".join(
            f" {lv.base_starts_s[n]:>16.1f} {lv.base_p50_ms[n]:>4.0f}ms {lv.base_p99_ms[n]:>4.0f}ms"
            for n in names
        )
        print(line)
    for lv in levels:
        ratios = "; ".join(
            f"{n}: {lv.base_starts_s[n] / max(lv.creates_per_s, 1e-9):.0f}x the rate, "
            f"create p50 {pct(lv.create_s, 0.5) * 1000 / lv.base_p50_ms[n]:.0f}x its p50"
            for n in names
        )
        print(f"  concurrency {lv.concurrency}, baseline vs sandbox creates: {ratios}")
        for e in lv.errors[:3]:
            print("    error:", e)
    k = knee(levels)
    if k is None:
        print(f"knee: none up to concurrency {levels[-1].concurrency} (creates/s still grows)")
    else:
        print(
            f"knee: at concurrency {k.concurrency} ({k.creates_per_s:.2f} creates/s; the next "
            f"level adds less than {KNEE_GAIN - 1:.0%}). Why: {cores} cores run every guest "
            f"under TCG (software emulation, {k.cpu_s / max(1, k.creates):.2f} CPU-s of server + "
            f"QEMU work per sandbox lifecycle, host {k.host_busy_pct:.0f}% busy there), and "
            f"AGENTENV_MAX_STARTS={max_starts} starts run at once (the rest queue or get 503)."
        )
    if idle is not None and idle.pss_mb:
        per_sbx = (idle.server_pss_mb - idle.server_pss_empty_mb) / idle.n
        print(
            f"memory: {idle.n} idle sandboxes (512 MiB guests from the template snapshot): "
            f"QEMU PSS mean {statistics.fmean(idle.pss_mb):.1f} MB (min {min(idle.pss_mb):.1f}, "
            f"max {max(idle.pss_mb):.1f}); server PSS {idle.server_pss_empty_mb:.1f} MB -> "
            f"{idle.server_pss_mb:.1f} MB ({per_sbx:.2f} MB per sandbox); idle CPU "
            f"(server + QEMUs) {idle.cpu_pct:.0f}% of a core, "
            f"{idle.cpu_pct / idle.n:.1f}% per sandbox"
        )
    for f in forks:
        print(
            f"fork of {f.n:>2}: {f.fork_s:6.2f}s ({f.fork_s / f.n:.3f}s/child) vs {f.n} single "
            f"creates from a snapshot {f.singles_s:6.2f}s ({f.singles_s / f.n:.3f}s each): "
            f"fork is {f.singles_s / f.fork_s:.2f}x; 503s {f.busy} {f.note}"
        )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-concurrency", type=int, default=64, help="run levels up to this")
    ap.add_argument("--rounds", type=int, default=2, help="creates per level = rounds x conc")
    ap.add_argument("--forks", default="8,32", help="fork sizes (empty: skip)")
    ap.add_argument("--no-install", action="store_true", help="do not apt-get bubblewrap")
    args = ap.parse_args()
    levels_c = [c for c in LEVELS if c <= args.max_concurrency]
    _install_busy_counter()
    cmds = baseline_commands(not args.no_install)
    cores = os.cpu_count() or 1
    max_starts = os.environ.get("AGENTENV_MAX_STARTS", f"default ({max(2, cores)})")
    with tempfile.TemporaryDirectory(prefix="aenv-bench-load-") as tmp:
        home = prepare_home(Path(tmp))
        with ServerProcess(home, ready_timeout_s=180) as server:
            opts: dict[str, Any] = {
                "api_key": server.api_key,
                "api_url": server.url,
                "sandbox_url": server.url,
                "retries": BUSY_RETRIES,
            }
            print(f"server {server.url}, {cores} cores, baselines {sorted(cmds)}", flush=True)
            # The first create builds the template snapshot; not part of any level.
            Sandbox.create(template="base", timeout=120, request_timeout=600, **opts).kill()
            levels = []
            for c in levels_c:
                lv = run_level(server, opts, c, max(MIN_CREATES, args.rounds * c))
                for name, cmd in cmds.items():
                    rate, p50, p99 = baseline(cmd, c)
                    lv.base_starts_s[name], lv.base_p50_ms[name], lv.base_p99_ms[name] = (
                        rate,
                        p50,
                        p99,
                    )
                print(
                    f"concurrency {c}: {lv.creates} creates in {lv.wall_s:.1f}s "
                    f"({lv.creates_per_s:.2f}/s), 503s {lv.busy}, refused {lv.refused}, "
                    f"errors {len(lv.errors)}",
                    flush=True,
                )
                levels.append(lv)
            idle = idle_memory(server, opts, min(16, args.max_concurrency))
            counts = [int(x) for x in args.forks.split(",") if x.strip()]
            forks = fork_vs_singles(server, opts, counts) if counts else []
    report(levels, forks, idle, cores, max_starts)
    return 1 if any(lv.errors for lv in levels) else 0


if __name__ == "__main__":
    sys.exit(main())
