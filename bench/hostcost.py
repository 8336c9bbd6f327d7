"""Host cost per sandbox operation (#23): the server's CPU, its helpers' CPU, and the processes
it spawns, per create, `commands.run`, kill, pause and resume, with the warm pool off and on,
and the floor beside them.

    .venv/bin/python bench/hostcost.py [-n 6] [--runs 5] [--pauses 2]

For each warm-pool setting a server is started as a child on its own home and a free loopback
port. Passes:

1. CPU: N sandboxes (create, `--runs` x `commands.run("true")`, kill), and `--pauses` more
   that are paused and resumed before their kill (`kill_resumed`: a resumed guest's RAM is
   a file in its workdir, and removing it frees those pages in the server's thread, where a
   plain sandbox's go with its QEMU's exit). The server's CPU around each operation, summed
   over its threads' schedstat (ns; the 10 ms ticks of /proc/<pid>/stat were ±1.25 ms on a
   row of 8 kills; a thread that ended in between would be missed, and the server's pools
   keep theirs); helpers' CPU is everything else the server's process tree spent over the
   pass (reaped children's cutime+cstime, and the live helpers' own and reaped time: the VM
   launcher), less the CPU of the QEMU processes (sampled every
   20 ms while they live, converters included): QEMU is the guest, not a helper. Work a
   process does between its fork and its exec of QEMU counts as QEMU's (before and after).
2. Spawns: `strace -f` attached to the server and its live helpers; successful execve's by
   program name and process creations (fork, vfork, clone/clone3 without CLONE_THREAD), per
   lifecycle and per VM start (a VM start is one exec of QEMU). strace slows what it traces,
   so CPU comes from pass 1 only. strace comes from Debian's `strace`.
   Before pass 1 the server's idle rate is read over 10 s (`server_idle_ms_per_s`, from
   schedstat); each operation's row is also given less that rate over its wall time
   (`..._less_idle_ms`): the housekeeping an idle server does meanwhile is not the
   operation's, and under TCG a command's wall time is mostly the guest's.
3. Floor: a bare QEMU restore of the same template snapshot by a few lines of script (a
   process of its own in a network namespace of its own, QEMU as its child with the argv
   and environment a sandbox's QEMU was started with, its own qcow2 upper over the same
   layer; QMP: load the device state, `cont`, then SIGKILL). Its CPU is the script's own
   (QEMU excluded, as above); the report gives our create+kill over it.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import re
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

TICK_MS = 1000 / os.sysconf("SC_CLK_TCK")
EXECVE_OK = re.compile(r'execve\("([^"]+)".*\)\s+=\s+0')
# A new process (not a thread): fork/vfork, or clone/clone3 without CLONE_THREAD, that
# returned a pid.
SPAWN = re.compile(r"\b(fork|vfork|clone3?)\((.*)\)\s+=\s+[1-9]")


def stat_fields(pid: int) -> list[str]:
    raw = Path(f"/proc/{pid}/stat").read_text()
    return raw[raw.rindex(")") + 2 :].split()  # fields from 3 (state) on


def own_ms(pid: int) -> float:
    f = stat_fields(pid)
    return (int(f[11]) + int(f[12])) * TICK_MS  # utime, stime


def sched_ms(pid: int) -> float:
    """CPU of the process's live threads in ns precision (schedstat), in ms: for a rate over
    a quiet window, where 10 ms ticks would be most of the reading."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except OSError:
            continue  # a thread that ended meanwhile
    return total / 1e6


def idle_rate(pid: int, seconds: float) -> float:
    """The server's CPU per second while it serves nothing (ms/s): its housekeeping (the
    reaper's, the memory manager's and the HTTP server's ticks). It runs during every
    operation too, so `server_<op>_less_idle_ms` takes rate x the operation's wall off."""
    t0, w0 = sched_ms(pid), time.monotonic()
    time.sleep(seconds)
    return (sched_ms(pid) - t0) / (time.monotonic() - w0)


def children_ms(pid: int) -> float:
    f = stat_fields(pid)
    return (int(f[13]) + int(f[14])) * TICK_MS  # cutime, cstime


def descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        parent = todo.pop()
        for task in Path(f"/proc/{parent}/task").glob("*"):
            try:
                kids = (task / "children").read_text().split()
            except OSError:
                continue
            for kid in map(int, kids):
                out.append(kid)
                todo.append(kid)
    return out


def is_qemu(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/comm").read_text().startswith("qemu")
    except OSError:
        return False


def helpers(server_pid: int) -> dict[int, tuple[float, float]]:
    """Live helpers under the server (not QEMU): pid -> (own CPU, reaped children's CPU)."""
    out: dict[int, tuple[float, float]] = {}
    for pid in descendants(server_pid):
        if not is_qemu(pid):
            try:
                out[pid] = (own_ms(pid), children_ms(pid))
            except OSError:
                continue
    return out


def ensure_strace() -> str:
    found = shutil.which("strace")
    if found:
        return found
    print("strace is missing: apt-get install strace", flush=True)
    subprocess.run(["apt-get", "install", "-y", "-qq", "strace"], check=True, timeout=600)
    found = shutil.which("strace")
    assert found, "strace did not install"
    return found


def lifecycle(
    opts: dict[str, Any], runs: int, pid: int, rows: dict[str, list[float]], pause: bool
) -> None:
    """One create, `runs` execs, (a pause and a resume,) one kill; appends server CPU and
    wall time per operation."""
    from e2b import Sandbox

    def timed(name: str, fn: Any) -> Any:
        t0, w0 = sched_ms(pid), time.monotonic()
        out = fn()
        rows[name].append(sched_ms(pid) - t0)
        rows[f"{name}_wall"].append((time.monotonic() - w0) * 1000)
        return out

    sbx = timed(
        "create", lambda: Sandbox.create(template="base", timeout=300, request_timeout=300, **opts)
    )
    for _ in range(runs):
        result = timed("exec", lambda: sbx.commands.run("true"))
        assert result.exit_code == 0
    if pause:
        assert timed("pause", sbx.pause) is True
        sbx = timed("resume", lambda: Sandbox.connect(sbx.sandbox_id, timeout=300, **opts))
    timed("kill_resumed" if pause else "kill", sbx.kill)


class QemuSampler:
    """The CPU of every QEMU under the server, sampled every 20 ms while it lives (the last
    sample of each counts): QEMUs end (kill, a converter's exit) between two reads of ours,
    and their CPU must not be taken for a helper's."""

    def __init__(self, server_pid: int) -> None:
        self.server_pid = server_pid
        # (pid, start time) -> (parent, last CPU seen)
        self.seen: dict[tuple[int, str], tuple[int, float]] = {}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.wait(0.02):
            for pid in descendants(self.server_pid):
                if is_qemu(pid):
                    try:
                        f = stat_fields(pid)
                        self.seen[(pid, f[19])] = (int(f[1]), (int(f[11]) + int(f[12])) * TICK_MS)
                    except (OSError, IndexError):
                        continue

    def __enter__(self) -> QemuSampler:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()

    def total(self, parents_not: set[int]) -> float:
        return sum(cpu for parent, cpu in self.seen.values() if parent not in parents_not)


def helper_cost(pid: int, work: Any) -> dict[str, float]:
    """Helpers' CPU while `work()` runs. A helper that lives through it (the VM launcher):
    its own CPU; its reaped children are QEMUs, left out. What the server reaped (the old
    launch chains, other spawns): its children's CPU less the sampled CPU of the QEMUs
    among them (their exit, after the last sample, is not seen: it counts as a helper's).
    `qemu_exit_unsampled_ms`: for QEMUs under a lasting helper, their whole CPU (reaped)
    less the sampled, i.e. what the same sampling misses per QEMU."""
    with QemuSampler(pid) as sampler:
        c0, before = children_ms(pid), helpers(pid)
        work()
        time.sleep(1.0)  # the last kill's QEMU reaped, its CPU in its parent's
        c1, after = children_ms(pid), helpers(pid)
    lasting = set(before) & set(after)
    own = sum(after[p][0] - before[p][0] for p in lasting)
    reaped_qemu = sum(after[p][1] - before[p][1] for p in lasting)
    sampled_under_lasting = sum(cpu for parent, cpu in sampler.seen.values() if parent in lasting)
    under_lasting = sum(1 for parent, _ in sampler.seen.values() if parent in lasting)
    by_name: collections.Counter[str] = collections.Counter()
    for p in lasting:
        try:
            name = Path(f"/proc/{p}/cmdline").read_bytes().split(b"\0")[:3]
        except OSError:
            continue
        by_name[" ".join(Path(w.decode()).name for w in name)] += after[p][0] - before[p][0]
    print("lasting helpers' own CPU:", dict(by_name), "reaped by the server:", c1 - c0, flush=True)
    return {
        "helpers": max(0.0, c1 - c0 - sampler.total(lasting)) + own,
        "qemu_exit_unsampled_ms": (reaped_qemu - sampled_under_lasting) / max(under_lasting, 1),
    }


def cpu_pass(opts: dict[str, Any], n: int, runs: int, pauses: int, pid: int) -> dict[str, float]:
    rows: dict[str, list[float]] = collections.defaultdict(list)
    idle = idle_rate(pid, 10.0)

    def plain() -> None:
        for _ in range(n):
            lifecycle(opts, runs, pid, rows, pause=False)

    def paused() -> None:
        for _ in range(pauses):
            lifecycle(opts, runs, pid, rows, pause=True)

    cost = helper_cost(pid, plain)
    with_pause = helper_cost(pid, paused) if pauses else None
    out = {f"server_{k}_ms": round(statistics.mean(v), 2) for k, v in rows.items()}
    out["server_idle_ms_per_s"] = round(idle, 2)
    for k, v in list(rows.items()):
        if not k.endswith("_wall"):
            walls = rows[f"{k}_wall"]
            less = statistics.mean(v) - idle * statistics.mean(walls) / 1000
            out[f"server_{k}_less_idle_ms"] = round(less, 2)
    out["helpers_per_lifecycle_ms"] = round(cost["helpers"] / n, 2)
    out["qemu_exit_unsampled_ms"] = round(cost["qemu_exit_unsampled_ms"], 2)
    if with_pause is not None:
        out["helpers_per_lifecycle_with_pause_resume_ms"] = round(with_pause["helpers"] / pauses, 2)
    out["server_create_exec_kill_ms"] = round(
        out["server_create_ms"] + runs * out["server_exec_ms"] + out["server_kill_ms"], 2
    )
    return out


def spawn_pass(opts: dict[str, Any], n: int, runs: int, pid: int, log: Path) -> dict[str, Any]:
    strace = ensure_strace()
    traced = [pid] + [p for p in descendants(pid) if not is_qemu(p)]
    calls = "trace=execve,fork,vfork,clone,clone3"
    # -ff: one file per thread, so no call is split into "unfinished"/"resumed" halves.
    argv = [strace, "-f", "-ff", "-qq", "-e", calls, "-e", "signal=none", "-o", str(log)]
    tracer = subprocess.Popen([*argv, *(a for p in traced for a in ("-p", str(p)))])
    try:
        time.sleep(1.0)  # strace attaches to every thread before it reports anything
        rows: dict[str, list[float]] = collections.defaultdict(list)
        for _ in range(n):
            lifecycle(opts, runs, pid, rows, pause=False)
    finally:
        tracer.terminate()
        tracer.wait(timeout=30)
    names: collections.Counter[str] = collections.Counter()
    forks = 0
    lines = [ln for f in log.parent.glob(log.name + ".*") for ln in f.read_text().splitlines()]
    for line in lines:
        m = EXECVE_OK.search(line)
        if m:
            names[Path(m.group(1)).name] += 1
        m = SPAWN.search(line)
        if m and "CLONE_THREAD" not in m.group(2):
            forks += 1
    starts = sum(c for name, c in names.items() if name.startswith("qemu-system"))
    per = max(starts, 1)
    return {
        "vm_starts": starts,
        "execve_per_lifecycle": {k: round(c / n, 2) for k, c in names.most_common()},
        "execve_per_vm_start": round(sum(names.values()) / per, 2),
        "forks_per_vm_start": round(forks / per, 2),
    }


def qemu_launch(server_pid: int) -> tuple[list[str], dict[str, str]]:
    """Argv and preload environment of a live sandbox QEMU of the server's."""
    for pid in descendants(server_pid):
        if is_qemu(pid):
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")[:-1]
            env = dict(
                e.split("=", 1)
                for e in Path(f"/proc/{pid}/environ").read_bytes().decode().split("\0")
                if e.startswith(("LD_PRELOAD=", "AGENTENV_PRIVATE_RAM="))
            )
            return argv, env
    raise RuntimeError("no QEMU found under the server")


def floor_pass(opts: dict[str, Any], pid: int, n: int, tmp: Path) -> dict[str, float]:
    from e2b import Sandbox

    from agentenv.vmm.confine import backing_chain

    sbx = Sandbox.create(template="base", timeout=300, request_timeout=300, **opts)
    try:
        argv, env = qemu_launch(pid)
        upper = next(Path(a.split('"filename":"')[1].split('"')[0]) for a in argv if "vda-0" in a)
        base = str(backing_chain(upper)[0])
    finally:
        sbx.kill()
    spec = tmp / "floor.json"
    floor_dir = str(tmp / "floor")
    spec.write_text(json.dumps({"argv": argv, "env": env, "n": n, "dir": floor_dir, "base": base}))
    out = subprocess.run(
        [sys.executable, __file__, "--floor", str(spec)],
        capture_output=True,
        text=True,
        timeout=400,
        check=False,
    )
    if out.returncode != 0:
        print(f"floor failed: {out.stderr[-3000:]}", flush=True)
        return {"floor_failed": 1.0}
    result: dict[str, float] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def floor_main(spec_path: str) -> None:
    """The floor: restore the template snapshot with a bare QEMU, `n` times (own netns, so
    QEMU's tap is made there and disappears with it)."""
    import ctypes
    import faulthandler

    from agentenv.vmm.qemu_base import QuietQMPClient

    # A blocking call the event loop's deadlines cannot cut: where it hangs, then exit.
    faulthandler.dump_traceback_later(240, exit=True)

    from agentenv.storage import create_upper_sync

    spec = json.loads(Path(spec_path).read_text())
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(0x40000000) != 0:  # CLONE_NEWNET
        raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWNET)")
    argv: list[str] = spec["argv"]
    upper = next(Path(a.split('"filename":"')[1].split('"')[0]) for a in argv if "vda-0" in a)
    work = Path(upper).parent
    mem = next(a for a in argv if "mem-path=" in a).split("mem-path=")[1].split(",")[0]
    state = Path(mem).parent / "state"
    base = Path(spec["base"])
    env = {**os.environ, **spec["env"]}

    async def once(i: int) -> tuple[float, float]:
        d = Path(spec["dir"]) / str(i)
        d.mkdir(parents=True)
        t0 = resource.getrusage(resource.RUSAGE_SELF)
        w0 = time.monotonic()
        create_upper_sync(base, d / "rootfs.qcow2")
        args = [a.replace(str(work), str(d)) for a in argv]
        # A bare script: blocking calls on purpose (nothing else runs in this loop).
        err = open(d / "qemu.stderr", "wb")  # noqa: ASYNC230, SIM115
        proc = subprocess.Popen(args, env=env, stdin=subprocess.DEVNULL, stderr=err)  # noqa: ASYNC220
        qmp = QuietQMPClient("floor")
        sock = str(d / "qmp.sock")
        deadline = time.monotonic() + 60
        while not os.path.exists(sock):  # noqa: ASYNC240
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"floor QEMU: {(d / 'qemu.stderr').read_text()[-2000:]}")
            await asyncio.sleep(0.002)
        await qmp.connect(sock)
        await qmp.execute(
            "migrate-set-capabilities",
            {"capabilities": [{"capability": "x-ignore-shared", "state": True}]},
        )
        fd = os.open(state, os.O_RDONLY)
        qmp.send_fd_scm(fd)
        os.close(fd)
        await qmp.execute("getfd", {"fdname": "s"})
        await qmp.execute("migrate-incoming", {"uri": "fd:s"})
        status: Any = await qmp.execute("query-status")
        while status["status"] == "inmigrate":
            if time.monotonic() > deadline:
                mig = await qmp.execute("query-migrate")
                raise RuntimeError(f"floor restore stuck: {mig} {(d / 'qemu.stderr').read_text()}")
            await asyncio.sleep(0.002)
            status = await qmp.execute("query-status")
        await qmp.execute("cont")
        wall = (time.monotonic() - w0) * 1000
        proc.send_signal(signal.SIGKILL)
        await qmp.disconnect()
        proc.wait()
        err.close()
        t1 = resource.getrusage(resource.RUSAGE_SELF)
        cpu = (t1.ru_utime - t0.ru_utime + t1.ru_stime - t0.ru_stime) * 1000
        return cpu, wall

    async def run() -> list[tuple[float, float]]:
        await once(-1)  # warm: imports, page cache
        return [await once(i) for i in range(spec["n"])]

    got = asyncio.run(asyncio.wait_for(run(), 300))
    print(
        json.dumps(
            {
                "floor_create_kill_ms": round(statistics.mean(c for c, _ in got), 2),
                "floor_restore_wall_ms": round(statistics.mean(w for _, w in got), 1),
            }
        )
    )


def measure(warm: bool, args: argparse.Namespace, tmp: Path) -> dict[str, object]:
    from agentenv.api.devserver import ServerProcess
    from agentenv.template.datadir import prepare_home

    env = {"AGENTENV_WARM_LOW": "1" if warm else "0", "AGENTENV_WARM_HIGH": "2" if warm else "0"}
    home = prepare_home(tmp / ("warm" if warm else "cold"))
    with ServerProcess(home, env=env, ready_timeout_s=180) as server:
        assert server.proc is not None
        pid = server.proc.pid
        opts = {"api_key": server.api_key, "api_url": server.url, "sandbox_url": server.url}
        lifecycle(opts, 1, pid, collections.defaultdict(list), pause=False)  # warm-up
        if args.spawns_only:
            return {"spawns": spawn_pass(opts, args.n, args.runs, pid, home / "strace.log")}
        cpu = cpu_pass(opts, args.n, args.runs, args.pauses, pid)
        spawns = spawn_pass(opts, args.n, args.runs, pid, home / "strace.log")
        out: dict[str, object] = {"cpu": cpu, "spawns": spawns}
        print(json.dumps(out), flush=True)
        if not warm:
            floor = floor_pass(opts, pid, args.n, home)
            if "floor_create_kill_ms" in floor:
                parts = ("server_create_ms", "server_kill_ms", "helpers_per_lifecycle_ms")
                ours = sum(cpu[k] for k in parts)
                floor["ours_create_kill_ms"] = round(ours, 2)
                floor["ratio"] = round(ours / max(floor["floor_create_kill_ms"], 0.01), 2)
                parts = ("server_create_less_idle_ms", "server_kill_less_idle_ms")
                ours = sum(cpu[k] for k in parts) + cpu["helpers_per_lifecycle_ms"]
                floor["ratio_less_idle"] = round(ours / max(floor["floor_create_kill_ms"], 0.01), 2)
            out["floor"] = floor
    return out


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--floor":
        floor_main(sys.argv[2])
        return
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("-n", type=int, default=6, help="sandboxes per pass")
    parser.add_argument("--runs", type=int, default=5, help="commands.run per sandbox")
    parser.add_argument("--pauses", type=int, default=2, help="sandboxes paused and resumed")
    parser.add_argument("--spawns-only", action="store_true", help="pass 2 only, pool off")
    args = parser.parse_args()
    report: dict[str, object] = {}
    with tempfile.TemporaryDirectory(prefix="aenv-hostcost-") as tmp:
        for warm in (False,) if args.spawns_only else (False, True):
            key = "warm_on" if warm else "warm_off"
            report[key] = measure(warm, args, Path(tmp))
            print(key, json.dumps(report[key]), flush=True)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
