"""Memory benchmark: host memory per idle sandbox and how many fit, balloon on and off.

- PSS of the QEMU process per idle 512 MiB sandbox: N restored from one template snapshot, and
  M cold-booted with RAM in a file of their own, first as they are (balloon off: nothing
  inflated; free page reporting stays on, it is part of every snapshot's device set) and then
  with the balloon inflated to the floor by the real `MemoryManager` (balloon on). Clones
  give memory back through `vmm.ramshim`, which keeps their discards off the template file.
- Where each row's PSS is (`/proc/PID/smaps`, mean per sandbox): QEMU's TCG translation cache
  (its one anonymous executable mapping; none under KVM), guest RAM (the memory-file or RAM
  mapping: private = pages the guest wrote since its restore, shared = its share of the
  template's page cache, or all of a cold boot's own file), QEMU's heap and malloc arenas
  (anonymous, not executable: device state, TCG's soft TLB and page descriptors, thread
  stacks), and binaries and libraries.
- For each row, how many such sandboxes would fit before host memory is 80% used and the
  overcommit ratio (their nominal memory / host memory). Extrapolated from the measured PSS
  and this host's current use; nothing is started to fill the host.

    .venv/bin/python bench/memory.py [--clones 20] [--cold 4] [--touch 0]

Cold boots take 12-25 s each under TCG on 2 shared cores: `--cold` is smaller than
`--clones` by default; the report says which N each row measured.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from agentenv.config import Settings
from agentenv.guest.envd.client import EnvdClient
from agentenv.node.host import Node, SandboxHandle
from agentenv.node.memory import (
    DEFLATED_SLACK,
    MemoryManager,
    MemoryPolicy,
    host_memory,
    read_pressure,
)

MIB = 1024 * 1024
MEM_MB = 512
SETTLE_S = 5.0
FILL = 0.80


# smaps categories, in report order.
PARTS = ("tcg", "ram_private", "ram_shared", "heap", "files", "other")


@dataclass
class Row:
    what: str
    n: int
    pss_mb: list[float]
    # Mean PSS per sandbox by `PARTS` (MB).
    parts: dict[str, float]

    @property
    def mean(self) -> float:
        return statistics.fmean(self.pss_mb)


async def sh(sb: SandboxHandle, cmd: str) -> None:
    async with EnvdClient(sb.envd_url) as envd:
        code, _, err = await envd.run(cmd, user="root", timeout=300)
    if code != 0:
        raise RuntimeError(f"{sb.id}: {cmd!r} failed: {err.strip()}")


def pss_mb(sb: SandboxHandle) -> float:
    mem = None if sb.pid is None else host_memory(sb.pid)
    return 0.0 if mem is None else mem.pss / MIB


def _part(name: str, perms: str, size: int) -> str:
    if size >= MEM_MB * MIB:
        return "ram"  # the guest's RAM: a memory file's mapping, or anonymous
    if not name and "x" in perms:
        return "tcg"  # QEMU's translation buffer (rwx, anonymous)
    if not name or name == "[heap]":
        return "heap"
    return "files" if name.startswith("/") else "other"


def smaps_parts(pid: int) -> dict[str, float]:
    """PSS of one QEMU by `PARTS`, in MB; guest RAM split into its private pages (written
    since the restore, or all of a cold boot's) and its share of pages other clones map."""
    kb: collections.Counter[str] = collections.Counter()
    part = "other"
    try:
        text = Path(f"/proc/{pid}/smaps").read_text()
    except OSError:
        return {}
    for line in text.splitlines():
        head, _, rest = line.partition(" ")
        if not head.endswith(":"):  # a mapping: range perms offset dev inode [name]
            fields = line.split(None, 5)
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            part = _part(fields[5].strip() if len(fields) > 5 else "", fields[1], hi - lo)
        elif head == "Pss:":
            kb["ram_shared" if part == "ram" else part] += int(rest.split()[0])
        elif head == "Anonymous:" and part == "ram":
            # A clone's own copies of pages it wrote (anonymous pages of its private mapping;
            # not Private_Dirty, which also counts a fresh template's page-cache pages not yet
            # written back while one process maps them): PSS = RSS, moved to their own part.
            own = int(rest.split()[0])
            kb["ram_private"] += own
            kb["ram_shared"] -= own
    return {k: kb[k] / 1024 for k in PARTS}


def mean_parts(sandboxes: Sequence[SandboxHandle]) -> dict[str, float]:
    got = [smaps_parts(sb.pid) for sb in sandboxes if sb.pid is not None]
    got = [g for g in got if g]
    return {k: statistics.fmean(g[k] for g in got) if got else 0.0 for k in PARTS}


async def settle(sandboxes: Sequence[SandboxHandle], touch_mb: int) -> None:
    """Every guest answers once; with `touch_mb` each also fills that much page cache (what a
    sandbox that ran a workload keeps until the balloon makes it drop it)."""
    fill = (
        f"dd if=/dev/zero of=/var/tmp/fill bs=1M count={touch_mb} status=none && sync"
        " && cat /var/tmp/fill > /dev/null"
    )
    for sb in sandboxes:
        await sh(sb, fill if touch_mb else "true")
    await asyncio.sleep(SETTLE_S)


async def inflate_all(node: Node, sbs: Sequence[SandboxHandle], floor: int) -> None:
    """The node's sandboxes all idle: the real manager inflates every balloon to the floor."""
    mm = MemoryManager(node.list, MemoryPolicy(idle_s=0.1, floor_mb=floor, pressure_pct=0))
    try:
        await mm.tick()
        await asyncio.sleep(0.2)
        await mm.tick()
        t0 = time.monotonic()
        for sb in sbs:
            for _ in range(600):
                if await sb.vm.balloon_query() <= floor * MIB + DEFLATED_SLACK:
                    break
                await asyncio.sleep(0.1)
        print(f"  {mm.inflations} balloons at {floor} MiB in {time.monotonic() - t0:.1f}s")
        await asyncio.sleep(SETTLE_S)
    finally:
        await mm.close()


async def measure(settings: Settings, n: int, touch_mb: int, *, cold: bool) -> tuple[Row, Row]:
    """(balloon off, balloon on) rows for `n` sandboxes restored from the template snapshot or
    cold-booted with RAM in a file of their own."""
    node = Node(settings, snapshots=False, mem_file=True) if cold else Node(settings)
    what = "cold-booted" if cold else f"restored from one {MEM_MB} MiB template"
    await node.start()
    try:
        sbs = []
        t0 = time.monotonic()
        for i in range(n):
            t1 = time.monotonic()
            sbs.append(await node.create("base", memory_mb=MEM_MB))
            if cold:
                print(f"  cold boot {i + 1}/{n} in {time.monotonic() - t1:.1f}s", flush=True)
        print(f"  {n} {what} in {time.monotonic() - t0:.1f}s", flush=True)
        await settle(sbs, touch_mb)
        off = Row(f"{what}, balloon off", n, [pss_mb(s) for s in sbs], mean_parts(sbs))
        floor = settings.balloon_floor_mb
        await inflate_all(node, sbs, floor)
        on = Row(f"{what}, balloon on ({floor} MiB)", n, [pss_mb(s) for s in sbs], mean_parts(sbs))
        return off, on
    finally:
        await node.close()


def report(rows: list[Row], baseline_used: float, total: float) -> None:
    """`baseline_used` and `total` in MiB."""
    print()
    print(f"host: {total / 1024:.1f} GiB, {baseline_used / 1024:.1f} GiB used before the bench")
    print(f"{'sandboxes':<58} {'N':>3} {'PSS/sandbox':>12} {'fit@80%':>8} {'overcommit':>10}")
    budget = FILL * total - baseline_used
    for r in rows:
        fit = int(budget // r.mean) if r.mean > 0 else 0
        ratio = fit * MEM_MB / total
        print(f"{r.what:<58} {r.n:>3} {r.mean:>9.1f} MB {fit:>8} {ratio:>9.1f}x")
    print("fit@80% and overcommit are extrapolated from the mean PSS, not measured by filling")
    print()
    print("PSS per sandbox by part (MB, mean; smaps):")
    print(f"{'sandboxes':<58} " + " ".join(f"{k:>11}" for k in PARTS))
    for r in rows:
        print(f"{r.what:<58} " + " ".join(f"{r.parts.get(k, 0.0):>11.1f}" for k in PARTS))


async def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--clones", type=int, default=20)
    ap.add_argument("--cold", type=int, default=4)
    ap.add_argument("--touch", type=int, default=0, help="MiB of page cache each guest fills")
    args = ap.parse_args(argv)
    if args.clones < 1 or args.cold < 0:
        ap.error("--clones must be at least 1 and --cold at least 0")
    before = read_pressure()
    with tempfile.TemporaryDirectory(prefix="aenv-bench-mem-") as tmp:
        from agentenv.template.rootfs import ensure_base

        settings = replace(
            Settings.from_env(), home=Path(tmp) / "home", idle_reclaim_s=0, memory_pressure_pct=0
        )
        await asyncio.to_thread(ensure_base, settings, None)
        print(f"{args.clones} sandboxes restored from the template snapshot", flush=True)
        rows = list(await measure(settings, args.clones, args.touch, cold=False))
        if args.cold:
            print(f"{args.cold} cold-booted sandboxes", flush=True)
            rows += list(await measure(settings, args.cold, args.touch, cold=True))
    report(rows, (before.total - before.available) / MIB, before.total / MIB)
    for r in rows:
        print(f"  {r.what}: PSS MB {', '.join(f'{p:.0f}' for p in r.pss_mb)}")


if __name__ == "__main__":
    asyncio.run(main())
