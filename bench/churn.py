"""Churn without drift: N cycles of create → `commands.run` → kill through the official E2B
SDK against a server process, mixed: every 10th cycle also pauses and resumes (connect)
before the kill, every 25th forks 2 children that are killed too. Cycles run on a few worker
threads. After a warm-up (the first 10% of the cycles) and at a few points after it, with no
sandbox running, the server's open fds, threads, RSS, the SQLite db size and the leftovers on
disk (sandbox dirs, warm entries, layers, snapshots), its QEMUs and the host's slot
namespaces are sampled; the drift is every later sample against the warm-up one, the baseline
measured in the same run.

    .venv/bin/python bench/churn.py [--cycles 1000] [--workers 4] [--samples 5]

tests/e2e/test_churn.py runs the same with 200 cycles and asserts that nothing drifts.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import itertools
import os
import sqlite3
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from e2b import Sandbox, ServiceBusyException

from agentenv.api.devserver import ServerProcess
from agentenv.template.datadir import prepare_home
from agentenv.vmm import registry

sys.path.insert(0, str(Path(__file__).parent))
import slots

PAUSE_EVERY = 10
FORK_EVERY = 25
FORK_CHILDREN = 2
WARMUP_FRACTION = 0.1
# A sandbox's create, pause, connect or fork refused with 503 is retried this often.
BUSY_TRIES = 20
SETTLE_S = 120.0
# The warm pool refills whenever an entry is taken (low = high), so that it is full, and the
# same, at every sample; the default (1/2) leaves 1 or 2 entries depending on timing.
WARM = 2
# Released slots the server keeps for reuse: fewer than the churn's peak, so that releases
# both keep slots and destroy them.
SLOT_POOL = 4
SERVER_ENV = {
    "AGENTENV_WARM_LOW": str(WARM),
    "AGENTENV_WARM_HIGH": str(WARM),
    "AGENTENV_SLOT_POOL_HIGH": str(SLOT_POOL),
}


@dataclass(frozen=True)
class Sample:
    """One reading of the server with no sandbox running."""

    cycles: int
    fds: int
    threads: int
    rss_kb: int
    db_bytes: int
    wal_bytes: int
    db_used_bytes: int  # pages in use as a reader sees them (the WAL's included)
    sandbox_dirs: int
    warm_entries: int
    layers: int
    snapshots: int
    qemus: int  # sandboxes' and converters' (not the warm pool's)
    warm_qemus: int
    netns: int  # slot namespaces this data dir holds (its markers), else the host's ae-s*
    pooled_slots: int  # of those, no VM's and reset for reuse (`slots.census`)
    stray_slots: str  # no VM's and not reset (left behind): their names, comma-separated

    @property
    def sqlite_bytes(self) -> int:
        return self.db_bytes + self.wal_bytes


def _status(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def _count(path: Path, pattern: str = "*") -> int:
    return sum(1 for _ in path.glob(pattern)) if path.is_dir() else 0


def home_qemus(home: Path) -> tuple[int, int]:
    """QEMU processes whose command line points into `home`: (sandboxes and converters,
    warm pool entries)."""
    warm_dir = str(home / "warm") + "/"
    other = warm = 0
    for cmd in registry.qemu_processes(str(home)).values():
        if warm_dir in cmd:
            warm += 1
        else:
            other += 1
    return other, warm


def db_used_bytes(db: Path) -> int:
    """The database's size in pages in use, independent of when the WAL is checkpointed
    (the WAL file itself stays at its high-water mark and is reused)."""
    if not db.exists():
        return 0
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=30)
    try:
        pages = con.execute("PRAGMA page_count").fetchone()[0]
        free = con.execute("PRAGMA freelist_count").fetchone()[0]
        size = con.execute("PRAGMA page_size").fetchone()[0]
    finally:
        con.close()
    return int((pages - free) * size)


def slot_netns(home: Path) -> int:
    """Slot namespaces held by this data dir: its slot markers (`<home>/run/slots`) that
    name an existing namespace; without markers, every ae-s* namespace on the host."""
    existing = set(os.listdir("/run/netns")) if os.path.isdir("/run/netns") else set()
    markers = home / "run" / "slots"
    if markers.is_dir():
        return len(existing & set(os.listdir(markers)))
    return sum(1 for n in existing if n.startswith("ae-s"))


def sample(server: ServerProcess, cycles: int) -> Sample:
    assert server.proc is not None
    pid, home = server.proc.pid, server.home
    other, warm = home_qemus(home)
    slot_states = slots.census(home)
    return Sample(
        cycles=cycles,
        fds=len(os.listdir(f"/proc/{pid}/fd")),
        threads=_status(pid, "Threads"),
        rss_kb=_status(pid, "VmRSS"),
        db_bytes=_size(home / "agentenv.db"),
        wal_bytes=_size(home / "agentenv.db-wal"),
        db_used_bytes=db_used_bytes(home / "agentenv.db"),
        sandbox_dirs=_count(home / "sandboxes"),
        # <warm>/<pid>-<rand>/<sandbox id>
        warm_entries=_count(home / "warm", "*/*"),
        layers=_count(home / "layers", "*.qcow2"),
        snapshots=sum(1 for p in (home / "snapshots").glob("*") if p.is_dir())
        if (home / "snapshots").is_dir()
        else 0,
        qemus=other,
        warm_qemus=warm,
        netns=slot_netns(home),
        pooled_slots=slot_states.pooled,
        stray_slots=",".join(slot_states.stray),
    )


def settle(server: ServerProcess, cycles: int, timeout_s: float = SETTLE_S) -> Sample:
    """A sample once nothing moves: no sandbox QEMU or dir, the warm pool full (WARM
    entries, as many QEMUs), and two readings 0.5 s apart agree on every count. After
    `timeout_s` the last reading is returned as it is (the caller's checks then fail)."""
    deadline = time.monotonic() + timeout_s
    last = sample(server, cycles)
    while time.monotonic() < deadline:
        time.sleep(0.5)
        now = sample(server, cycles)
        quiet = now.qemus == 0 and now.sandbox_dirs == 0 and now.warm_qemus == now.warm_entries
        quiet = quiet and now.warm_entries == WARM
        counts = (
            "warm_entries", "layers", "snapshots", "warm_qemus", "netns", "pooled_slots",
            "threads",
        )  # fmt: skip
        if quiet and all(getattr(now, k) == getattr(last, k) for k in counts):
            return now
        last = now
    return last


@dataclass
class Counters:
    busy: int = 0  # 503 answers (retried)
    errors: list[str] = field(default_factory=list)
    creates: int = 0
    pauses: int = 0
    forks: int = 0
    cycle_s: list[float] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)


def _busy_retry(c: Counters, what: Callable[[], Any]) -> Any:
    """`what()`, retried (bounded) while the server answers 503: the SDK itself retries
    with the Retry-After header first (`retries` below), this counts and waits once more."""
    for attempt in range(BUSY_TRIES):
        try:
            return what()
        except ServiceBusyException:
            with c.lock:
                c.busy += 1
            if attempt == BUSY_TRIES - 1:
                raise
            time.sleep(min(5.0, 0.2 * 2**attempt))
    raise AssertionError("unreachable")


def cycle(
    i: int,
    opts: dict[str, Any],
    c: Counters,
    pause_every: int = PAUSE_EVERY,
    fork_every: int = FORK_EVERY,
) -> None:
    """One create → run → kill, with a pause + connect every `pause_every`-th cycle and a
    fork every `fork_every`-th (both happen in the warm-up)."""
    t0 = time.perf_counter()
    s = _busy_retry(
        c, lambda: Sandbox.create(template="base", timeout=600, request_timeout=300, **opts)
    )
    try:
        out = s.commands.run(f"echo churn-{i}").stdout
        if out != f"churn-{i}\n":
            raise AssertionError(f"cycle {i}: commands.run said {out!r}")
        if i % pause_every == pause_every - 1:
            s.files.write("/home/user/churn", str(i))
            if _busy_retry(c, s.pause) is not True:
                raise AssertionError(f"cycle {i}: pause did not pause")
            s = _busy_retry(
                c, lambda: Sandbox.connect(s.sandbox_id, timeout=600, request_timeout=300, **opts)
            )
            got = s.commands.run("cat /home/user/churn").stdout
            if got != str(i):
                raise AssertionError(f"cycle {i}: after resume the file says {got!r}")
            with c.lock:
                c.pauses += 1
        if i % fork_every == fork_every - 1:
            kids = _busy_retry(c, lambda: s.fork(count=FORK_CHILDREN, timeout=600))
            try:
                bad = [k for k in kids if isinstance(k, Exception)]
                if bad or len(kids) != FORK_CHILDREN:
                    raise AssertionError(f"cycle {i}: fork gave {kids!r}")
                for k in kids:
                    if k.commands.run("hostname").stdout.strip() == "":
                        raise AssertionError(f"cycle {i}: a fork child has no hostname")
            finally:
                for k in kids:
                    if isinstance(k, Sandbox):
                        k.kill()
            with c.lock:
                c.forks += 1
    finally:
        s.kill()
    with c.lock:
        c.creates += 1
        c.cycle_s.append(time.perf_counter() - t0)


def run_cycles(
    first: int,
    last: int,
    workers: int,
    opts: dict[str, Any],
    c: Counters,
    pause_every: int = PAUSE_EVERY,
    fork_every: int = FORK_EVERY,
) -> None:
    """Cycles [first, last) on `workers` threads; a failed cycle is recorded, not raised."""

    def one(i: int) -> None:
        try:
            cycle(i, opts, c, pause_every, fork_every)
        except Exception as exc:
            with c.lock:
                c.errors.append(f"cycle {i}: {type(exc).__name__}: {exc}")

    with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="churn") as pool:
        list(pool.map(one, range(first, last)))


@dataclass
class ChurnReport:
    cycles: int
    workers: int
    wall_s: float
    samples: list[Sample]  # [0] is the warm-up baseline
    counters: Counters

    @property
    def base(self) -> Sample:
        return self.samples[0]

    @property
    def end(self) -> Sample:
        return self.samples[-1]

    def drift(self) -> dict[str, float]:
        b, e = self.base, self.end
        n = max(1, e.cycles - b.cycles)
        return {
            "fds": e.fds - b.fds,
            "threads": e.threads - b.threads,
            "rss_mb": (e.rss_kb - b.rss_kb) / 1024,
            "sqlite_files_bytes_per_cycle": (e.sqlite_bytes - b.sqlite_bytes) / n,
            "sqlite_used_bytes_per_cycle": (e.db_used_bytes - b.db_used_bytes) / n,
            "wal_bytes": e.wal_bytes,
            "sandbox_dirs": e.sandbox_dirs,
            "warm_entries": e.warm_entries - b.warm_entries,
            "layers": e.layers - b.layers,
            "snapshots": e.snapshots - b.snapshots,
            "qemus": e.qemus,
            "warm_qemus_minus_entries": e.warm_qemus - e.warm_entries,
            # Slots no VM holds and the pool does not keep, and the growth of the others.
            "stray_slots": len(e.stray_slots.split(",")) if e.stray_slots else 0,
            "held_netns": (e.netns - e.pooled_slots) - (b.netns - b.pooled_slots),
        }


def churn(
    server: ServerProcess,
    cycles: int,
    workers: int = 4,
    samples: int = 4,
    progress: Callable[[str], None] = print,
    pause_every: int = PAUSE_EVERY,
    fork_every: int = FORK_EVERY,
) -> ChurnReport:
    """Run `cycles` cycles; sample after the warm-up and after each of `samples` equal
    chunks of the rest, each time with the workers drained and the server settled."""
    opts: dict[str, Any] = {
        "api_key": server.api_key,
        "api_url": server.url,
        "sandbox_url": server.url,
        "retries": 3,
    }
    c = Counters()
    warmup = max(1, round(cycles * WARMUP_FRACTION))
    t0 = time.monotonic()
    run_cycles(0, warmup, workers, opts, c, pause_every, fork_every)
    taken = [settle(server, warmup)]
    progress(f"warm-up: {warmup} cycles in {time.monotonic() - t0:.1f}s  {taken[0]}")
    rest = cycles - warmup
    bounds = [warmup + rest * k // samples for k in range(samples + 1)]
    for lo, hi in itertools.pairwise(bounds):
        if hi <= lo:
            continue
        run_cycles(lo, hi, workers, opts, c, pause_every, fork_every)
        taken.append(settle(server, hi))
        progress(f"{hi}/{cycles} cycles, {time.monotonic() - t0:.1f}s, errors {len(c.errors)}")
    return ChurnReport(cycles, workers, time.monotonic() - t0, taken, c)


def print_report(r: ChurnReport) -> None:
    cs = sorted(r.counters.cycle_s)
    p = (lambda q: cs[min(len(cs) - 1, round(q * (len(cs) - 1)))]) if cs else (lambda q: 0.0)
    print(
        f"{r.cycles} cycles on {r.workers} workers in {r.wall_s:.1f}s "
        f"({r.cycles / r.wall_s:.2f} cycles/s); cycle p50 {p(0.5):.2f}s p99 {p(0.99):.2f}s "
        f"(mean {statistics.fmean(cs) if cs else 0:.2f}s); pauses {r.counters.pauses}, "
        f"forks {r.counters.forks}, 503s {r.counters.busy}, errors {len(r.counters.errors)}"
    )
    keys = list(asdict(r.base))
    print("  ".join(f"{k:>12}" for k in keys))
    for s in r.samples:
        print("  ".join(f"{v:>12}" for v in asdict(s).values()))
    print("drift (last sample vs warm-up):")
    for k, v in r.drift().items():
        print(f"  {k:28} {v:10.1f}")
    for e in r.counters.errors[:10]:
        print("  error:", e)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cycles", type=int, default=1000)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--samples", type=int, default=5, help="samples after the warm-up")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="aenv-bench-churn-") as tmp:
        home = prepare_home(Path(tmp))
        with ServerProcess(home, env=SERVER_ENV, ready_timeout_s=180) as server:
            print(f"server {server.url}, home {home}", flush=True)
            report = churn(
                server, args.cycles, args.workers, args.samples, lambda m: print(m, flush=True)
            )
        print_report(report)
    return 1 if report.counters.errors else 0


if __name__ == "__main__":
    sys.exit(main())
