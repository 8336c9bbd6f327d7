"""Contained guests: what one abusive sandbox does to its neighbour and to the host.

A neighbour sandbox runs a steady loop of `commands.run("true")` through the official E2B
SDK; its exec latency idle (the baseline, measured in the same run) is compared with its
latency while a second sandbox, fresh for each scenario, abuses its own VM:

- ``fork_bomb``: bash's `:(){ :|:& };:`
- ``disk_fill``: `dd` of zeros onto its disk until the disk is full (or the window ends)
- ``memory_hog``: allocating beyond its RAM, again and again (the guest's OOM killer)
- ``stdout_streamed`` / ``stdout_unread``: a flood on stdout, read by a client as fast as it
  comes, or by nobody (a background command whose stream is never read)
- ``sockets``: thousands of TCP connections inside the guest (loopback, as root)
- ``cpu_busy``: every vCPU spinning

For each: neighbour p50/p99 and the ratio of p99 to the idle p99, the server's `/health`
(every check must answer 200), host MemAvailable and free disk of the data dir (minimum
seen, against the admission floors), the server's RSS growth, how long the kill of the
abusive sandbox took and whether anything of it was left (QEMU, VM record, cgroup, slot,
sandbox dir). Ratios, not timed assertions: tests/e2e/test_abuse.py runs the same scenarios at
a reduced scale and asserts loose bounds.

    .venv/bin/python bench/abuse.py [--window 30] [--only fork_bomb,cpu_busy] [--json out]
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
from e2b import Sandbox

from agentenv.api.devserver import ServerProcess
from agentenv.template.datadir import prepare_home
from agentenv.vmm import cgroup, registry

sys.path.insert(0, str(Path(__file__).parent))
import slots

# Every loop here is bounded: by a count, by a deadline, or both.
MAX_EXECS = 100_000
EXEC_TIMEOUT_S = 60.0
HEALTH_TIMEOUT_S = 5.0
WATCH_EVERY_S = 0.5
RAMP_S = 2.0
KILL_SETTLE_S = 30.0
# How long a client's command stream may take to end once its sandbox was killed.
STREAM_END_S = 10.0
SANDBOX_TIMEOUT_S = 1800
# The tools layer's Python: in every guest, whatever the template's rootfs has.
PY = "/.agentenv/bin/python"


@dataclass(frozen=True)
class Scale:
    window_s: float
    idle_execs: int
    stdout_bytes: int
    sockets: int
    # A scenario that ends on its own (the streamed flood, a disk fill) is measured until it
    # ends, but never longer than this.
    cap_s: float
    # disk_fill: run dd until the disk is full (else only for the window).
    fill_disk: bool


BENCH = Scale(
    window_s=30.0, idle_execs=100, stdout_bytes=10**9, sockets=10_000, cap_s=900, fill_disk=True
)
SUITE = Scale(
    window_s=6.0, idle_execs=30, stdout_bytes=10**8, sockets=2_000, cap_s=120, fill_disk=False
)


def percentile(values: list[float], pct: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    k = min(len(ordered) - 1, max(0, round(pct / 100 * (len(ordered) - 1))))
    return ordered[k]


@dataclass
class Latency:
    samples: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    @property
    def p50(self) -> float:
        return percentile(self.samples, 50)

    @property
    def p95(self) -> float:
        return percentile(self.samples, 95)

    @property
    def p99(self) -> float:
        return percentile(self.samples, 99)

    @property
    def max(self) -> float:
        return max(self.samples, default=float("nan"))


def exec_loop(
    sbx: Sandbox, *, count: int | None = None, until: Callable[[], bool] | None = None
) -> Latency:
    """`commands.run("true")` `count` times, or until `until()` says stop."""
    out = Latency()
    for i in range(count or MAX_EXECS):
        if until is not None and until():
            break
        t0 = time.monotonic()
        try:
            res = sbx.commands.run("true", timeout=EXEC_TIMEOUT_S)
            if res.exit_code != 0:
                out.errors.append(f"exec {i}: exit {res.exit_code}")
        except Exception as exc:
            out.errors.append(f"exec {i}: {type(exc).__name__}: {exc}")
            continue
        out.samples.append(time.monotonic() - t0)
    return out


def _mem_available_mb() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _free_disk_mb(path: Path) -> float:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize / 2**20


def _rss_mb(pid: int | None) -> float:
    if pid is None:
        return float("nan")
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def _cpu_s(pid: int | None) -> float:
    """User + system CPU seconds of a process (all its threads)."""
    if pid is None:
        return 0.0
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _used_mb(path: Path | None) -> float:
    """Space a (sparse) file takes on the host."""
    try:
        return 0.0 if path is None else path.stat().st_blocks * 512 / 2**20
    except OSError:
        return 0.0


class Watch:
    """Samples the server's /health, host memory, free disk and the server's RSS on a
    thread while a scenario runs."""

    def __init__(
        self, server: ServerProcess, abuser_pid: int | None = None, upper: Path | None = None
    ) -> None:
        self.server = server
        # Evidence that the abuse happened: the abusive QEMU's CPU time and peak RSS, and
        # how much its disk upper grew on the host.
        self.abuser_pid = abuser_pid
        self.upper = upper
        self.abuser_cpu0 = _cpu_s(abuser_pid)
        self.abuser_cpu_s = 0.0
        self.abuser_max_rss_mb = 0.0
        self.upper0_mb = _used_mb(upper)
        self.upper_growth_mb = 0.0
        self.health_bad: list[str] = []
        self.health_checks = 0
        self.health_max_s = 0.0
        self.min_mem_mb = float("inf")
        self.min_disk_mb = float("inf")
        self.max_rss_mb = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="abuse-watch", daemon=True)

    def __enter__(self) -> Watch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=2 * HEALTH_TIMEOUT_S + 1)

    def _run(self) -> None:
        with httpx.Client(base_url=self.server.url, timeout=HEALTH_TIMEOUT_S) as client:
            while not self._stop.is_set():
                t0 = time.monotonic()
                try:
                    resp = client.get("/health")
                    if resp.status_code != 200:
                        self.health_bad.append(f"{resp.status_code} {resp.text[:200]}")
                except httpx.HTTPError as exc:
                    self.health_bad.append(f"{type(exc).__name__}: {exc}")
                self.health_checks += 1
                self.health_max_s = max(self.health_max_s, time.monotonic() - t0)
                self.min_mem_mb = min(self.min_mem_mb, _mem_available_mb())
                self.min_disk_mb = min(self.min_disk_mb, _free_disk_mb(self.server.home))
                self.max_rss_mb = max(self.max_rss_mb, _rss_mb(self.server.pid))
                self.abuser_cpu_s = _cpu_s(self.abuser_pid) - self.abuser_cpu0
                self.abuser_max_rss_mb = max(self.abuser_max_rss_mb, _rss_mb(self.abuser_pid))
                self.upper_growth_mb = _used_mb(self.upper) - self.upper0_mb
                self._stop.wait(WATCH_EVERY_S)


class Abuse:
    """One abusive command running in a sandbox, on a thread of its own (the SDK call
    blocks while the command runs). The neighbour is measured for the scale's window, or,
    with `finished`, until that says so (after at least `min_s`; never past the cap)."""

    def __init__(
        self,
        run: Callable[[Abuse], Any],
        *,
        finished: Callable[[Abuse], bool] | None = None,
        min_s: float = 1.0,
    ) -> None:
        self.error: str | None = None
        self.detail: dict[str, Any] = {}
        self.finished = finished
        self.min_s = min_s
        # Set once the sandbox was killed: a command that waits on its own ends.
        self.stopping = threading.Event()
        self._done = threading.Event()
        self.started_at = time.monotonic()

        def body() -> None:
            try:
                run(self)
            except Exception as exc:
                if not self.stopping.is_set():
                    self.error = f"{type(exc).__name__}: {str(exc)[:300]}"
            finally:
                self._done.set()

        self._thread = threading.Thread(target=body, name="abuse-cmd", daemon=True)
        self._thread.start()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def join(self, timeout_s: float) -> None:
        self.stopping.set()
        self._thread.join(timeout_s)


def _foreground(sbx: Sandbox, cmd: str, *, user: str = "user") -> Callable[[Abuse], Any]:
    def run(abuse: Abuse) -> Any:
        return sbx.commands.run(cmd, user=user, timeout=0, retain_output=False)

    return run


def fork_bomb(sbx: Sandbox, scale: Scale) -> Abuse:
    return Abuse(_foreground(sbx, "bash -c ':(){ :|:& };:' >/dev/null 2>&1; sleep infinity"))


def disk_fill(sbx: Sandbox, scale: Scale) -> Abuse:
    fill = _foreground(sbx, "dd if=/dev/zero of=/home/user/fill bs=1M 2>&1; sync")
    if not scale.fill_disk:
        return Abuse(fill)

    def run(abuse: Abuse) -> None:
        try:
            fill(abuse)
        except Exception as exc:
            # dd ends with "No space left on device": the disk is full, as meant.
            if "No space left" not in str(exc):
                raise
        abuse.detail["filled_in_s"] = round(time.monotonic() - abuse.started_at, 1)

    return Abuse(run, finished=lambda a: a.done)


def memory_hog(sbx: Sandbox, scale: Scale) -> Abuse:
    # Real pages (bytes * n writes them), 64 MiB at a time until the guest's OOM killer
    # ends it; then again.
    hog = f"{PY} -c \"import itertools; b = [b'x' * (64 << 20) for _ in itertools.count()]\""
    return Abuse(_foreground(sbx, f"while :; do {hog} >/dev/null 2>&1; done"))


def _flood_cmd(n: int) -> str:
    return f"yes 0123456789abcdefghijklmnopqrstuvwxyz | head -c {n}"


def stdout_streamed(sbx: Sandbox, scale: Scale) -> Abuse:
    def run(abuse: Abuse) -> None:
        abuse.detail["bytes"] = 0

        def count(chunk: str) -> None:
            abuse.detail["bytes"] += len(chunk)

        sbx.commands.run(
            _flood_cmd(scale.stdout_bytes), timeout=0, retain_output=False, on_stdout=count
        )
        took = time.monotonic() - abuse.started_at
        abuse.detail["seconds"] = round(took, 1)
        abuse.detail["mb_s"] = round(abuse.detail["bytes"] / took / 1e6, 1)

    return Abuse(run, finished=lambda a: a.done)


def stdout_unread(sbx: Sandbox, scale: Scale) -> Abuse:
    # Started, and its stream never read: envd's bounded buffers fill, then the process
    # blocks on its pipe. The handle is kept (unread) so the stream stays open.
    def run(abuse: Abuse) -> None:
        handle = sbx.commands.run(
            _flood_cmd(scale.stdout_bytes), background=True, timeout=0, retain_output=False
        )
        abuse.stopping.wait(scale.cap_s)
        del handle

    return Abuse(run)


def sockets(sbx: Sandbox, scale: Scale) -> Abuse:
    n = scale.sockets
    script = (
        "import socket, time\n"
        "l = socket.socket(); l.bind(('127.0.0.1', 0)); l.listen(4096)\n"
        "keep = []\n"
        f"for i in range({n}):\n"
        "    keep.append(socket.create_connection(l.getsockname())); keep.append(l.accept()[0])\n"
        "print('open', len(keep) // 2, flush=True)\n"
        "time.sleep(3600)\n"
    )

    def run(abuse: Abuse) -> None:
        def seen(chunk: str) -> None:
            if "open" in chunk:
                abuse.detail["opened"] = chunk.strip()
                abuse.detail["opened_after_s"] = round(time.monotonic() - abuse.started_at, 1)

        sbx.commands.run(
            f"ulimit -n {2 * n + 256} && {PY} -c {shlex.quote(script)}",
            user="root",
            timeout=0,
            retain_output=False,
            on_stdout=seen,
        )

    # Measured while they are opened and then held for the window.
    return Abuse(run, finished=lambda a: "opened" in a.detail, min_s=scale.window_s)


def cpu_busy(sbx: Sandbox, scale: Scale) -> Abuse:
    return Abuse(
        _foreground(sbx, "for i in $(seq $(nproc)); do (while :; do :; done) & done; wait")
    )


SCENARIOS: dict[str, Callable[[Sandbox, Scale], Abuse]] = {
    "fork_bomb": fork_bomb,
    "disk_fill": disk_fill,
    "memory_hog": memory_hog,
    "stdout_streamed": stdout_streamed,
    "stdout_unread": stdout_unread,
    "sockets": sockets,
    "cpu_busy": cpu_busy,
}


def runtime_id(sbx: Sandbox) -> str:
    """The node's name for a sandbox: its guest's hostname."""
    return str(sbx.commands.run("hostname", timeout=EXEC_TIMEOUT_S).stdout).strip()


def leftovers(home: Path, rid: str, netns: str | None) -> list[str]:
    """What of the sandbox `rid` is still on the host."""
    found = [f"qemu {pid}" for pid, cmd in registry.qemu_processes(str(home)).items() if rid in cmd]
    records = registry.load_all(home / "run" / "vms")
    found += [f"vm record {r.name}" for r in records if r.name == rid]
    found += [f"cgroup {d / rid}" for d in cgroup.parent_dirs() if (d / rid).exists()]
    if (home / "sandboxes" / rid).exists():
        found.append(f"sandbox dir {rid}")
    # A released slot may already hold a new warm entry (then another VM names it), or wait
    # in the server's slot pool for reuse (then it was reset).
    held = netns is not None and (home / "run" / "slots" / netns).exists()
    if held and not any((r.spec or {}).get("netns") == netns for r in records):
        assert netns is not None
        if not slots.pooled(home, netns):
            found.append(f"slot {netns}")
    return found


def vm_record(home: Path, rid: str) -> registry.VMRecord | None:
    for rec in registry.load_all(home / "run" / "vms"):
        if rec.name == rid:
            return rec
    return None


@dataclass
class Result:
    name: str
    idle_p50_s: float
    idle_p99_s: float
    p50_s: float
    p95_s: float
    p99_s: float
    max_s: float
    execs: int
    exec_errors: list[str]
    measured_s: float
    health_checks: int
    health_bad: list[str]
    health_max_s: float
    min_mem_available_mb: float
    min_free_disk_mb: float
    server_rss_growth_mb: float
    kill_s: float
    leftovers: list[str]
    abuse_error: str | None
    detail: dict[str, Any]

    @property
    def ratio(self) -> float:
        return self.p99_s / self.idle_p99_s

    def line(self) -> str:
        return (
            f"{self.name:16s} p50 {self.p50_s * 1000:6.0f} ms  p95 {self.p95_s * 1000:6.0f} ms  "
            f"p99 {self.p99_s * 1000:6.0f} ms  max {self.max_s * 1000:6.0f} ms  "
            f"p99/idle {self.ratio:5.2f}x  execs {self.execs:4d}  health {self.health_checks} "
            f"bad {len(self.health_bad)} max {self.health_max_s:.2f}s  "
            f"mem>={self.min_mem_available_mb:.0f}MB "
            f"disk>={self.min_free_disk_mb:.0f}MB  rss+{self.server_rss_growth_mb:.0f}MB  "
            f"kill {self.kill_s:.2f}s  left {self.leftovers or '-'}  {self.detail}"
        )


def run_scenario(
    name: str, server: ServerProcess, neighbour: Sandbox, idle: Latency, scale: Scale
) -> Result:
    abuser = Sandbox.create(timeout=SANDBOX_TIMEOUT_S)
    try:
        rid = runtime_id(abuser)
        rec = vm_record(server.home, rid)
        netns = None if rec is None else (rec.spec or {}).get("netns")
        rss0 = _rss_mb(server.pid)
        abuse = SCENARIOS[name](abuser, scale)
        time.sleep(RAMP_S)
        t0 = time.monotonic()

        def stop() -> bool:
            took = time.monotonic() - t0
            if abuse.finished is None:
                return took >= scale.window_s
            return took >= scale.cap_s or (took >= abuse.min_s and abuse.finished(abuse))

        drives = (rec.spec or {}).get("drives", []) if rec is not None else []
        upper = Path(drives[0]["path"]) if drives else None
        with Watch(server, None if rec is None else rec.pid, upper) as watch:
            lat = exec_loop(neighbour, until=stop)
        measured = time.monotonic() - t0
    except BaseException:
        abuser.kill()
        raise
    abuse.stopping.set()
    k0 = time.monotonic()
    abuser.kill()
    kill_s = time.monotonic() - k0
    deadline = time.monotonic() + KILL_SETTLE_S
    left = leftovers(server.home, rid, netns)
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = leftovers(server.home, rid, netns)
    abuse.join(STREAM_END_S)
    detail = dict(abuse.detail)
    detail["abuser_cpu_s"] = round(watch.abuser_cpu_s, 1)
    detail["abuser_max_rss_mb"] = round(watch.abuser_max_rss_mb)
    detail["upper_growth_mb"] = round(watch.upper_growth_mb)
    if not abuse.done:
        # The client's stream of a command in a killed sandbox should end, not hang.
        detail["stream_open_after_kill"] = True
    return Result(
        name=name,
        idle_p50_s=idle.p50,
        idle_p99_s=idle.p99,
        p50_s=lat.p50,
        p95_s=lat.p95,
        p99_s=lat.p99,
        max_s=lat.max,
        execs=len(lat.samples),
        exec_errors=lat.errors[:5],
        measured_s=round(measured, 1),
        health_checks=watch.health_checks,
        health_bad=watch.health_bad[:5],
        health_max_s=watch.health_max_s,
        min_mem_available_mb=watch.min_mem_mb,
        min_free_disk_mb=watch.min_disk_mb,
        server_rss_growth_mb=watch.max_rss_mb - rss0,
        kill_s=kill_s,
        leftovers=left,
        abuse_error=abuse.error,
        detail=detail,
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--window", type=float, default=BENCH.window_s)
    parser.add_argument("--only", default="", help="comma-separated scenarios")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    scale = Scale(**{**asdict(BENCH), "window_s": args.window})
    names = [n for n in args.only.split(",") if n] or list(SCENARIOS)
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        parser.error(f"unknown scenarios {unknown}; known: {', '.join(SCENARIOS)}")
    with tempfile.TemporaryDirectory(prefix="agentenv-abuse-") as tmp:
        home = prepare_home(Path(tmp) / "home")
        server = ServerProcess(home, domain="sbx.test", ready_timeout_s=300).start()
        os.environ.update(server.sdk_env())
        results: list[Result] = []
        try:
            neighbour = Sandbox.create(timeout=SANDBOX_TIMEOUT_S)
            exec_loop(neighbour, count=5)  # warm-up: first connections, page cache
            idle = exec_loop(neighbour, count=scale.idle_execs)
            print(
                f"idle neighbour: p50 {idle.p50 * 1000:.0f} ms, p99 {idle.p99 * 1000:.0f} ms "
                f"({len(idle.samples)} execs)",
                flush=True,
            )
            for name in names:
                result = run_scenario(name, server, neighbour, idle, scale)
                results.append(result)
                print(result.line(), flush=True)
            after = exec_loop(neighbour, count=scale.idle_execs)
            print(f"idle again: p50 {after.p50 * 1000:.0f} ms, p99 {after.p99 * 1000:.0f} ms")
            neighbour.kill()
        finally:
            server.stop(timeout_s=120)
        if args.json is not None:
            args.json.write_text(
                json.dumps([{**asdict(r), "ratio": r.ratio} for r in results], indent=2)
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
