"""Snapshot benchmark, one run, every number side by side:

- create from the template snapshot (p50/p99), from a warm pool entry, and a cold boot of the
  same template, with ratios;
- pause and resume of 256 MiB and 1 GiB guests with 10% and 50% of their RAM dirtied (the
  first pause of a sandbox created from a template writes a RAM stream; later ones only
  device state);
- fork of 1, 8 and 32 children (total and per child);
- host memory (PSS of the QEMU process) per idle sandbox: N restored from one 512 MiB
  template vs N cold-booted, each with the balloon off and then inflated to the floor
  (bench/memory.py does the measuring);
- how many idle 512 MiB sandboxes would fit before host memory is 80% used and the overcommit
  ratio, for each of those rows (extrapolated from the PSS; nothing is started to fill the
  host).

    .venv/bin/python bench/snapshots.py [--creates 20] [--cold 3] [--idle 20] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from agentenv.config import Settings
from agentenv.guest.envd.client import EnvdClient
from agentenv.node.host import Node, SandboxHandle
from agentenv.node.memory import read_pressure
from agentenv.node.warm import Shape

sys.path.insert(0, str(Path(__file__).parent))
import memory as membench

MIB = 1024 * 1024


def pct(xs: Sequence[float], p: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, round(p / 100 * (len(s) - 1)))]


def pss_mb(pid: int | None) -> float:
    if pid is None:
        return 0.0
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1]) / 1024
    return 0.0


async def sh(sb: SandboxHandle, cmd: str) -> str:
    async with EnvdClient(sb.envd_url) as envd:
        code, out, err = await envd.run(cmd, user="root", timeout=300)
    if code != 0:
        raise RuntimeError(f"{cmd!r} failed: {err}")
    return out


async def _creates(node: Node, n: int, *, warm: bool) -> list[float]:
    """`n` creates, each deleted again; with `warm`, each waits (bounded) until the pool has
    an entry ready, as on a node that is not creating faster than the pool refills."""
    shape = Shape("base", 1, 512)
    xs = []
    for _ in range(n):
        if warm:
            for _ in range(600):
                if node.warm.ready(shape):
                    break
                await asyncio.sleep(0.05)
        t0 = time.monotonic()
        sb = await node.create("base", memory_mb=512)
        xs.append(time.monotonic() - t0)
        if warm and sb.origin != "warm":
            print(f"  (create {len(xs)} found no warm entry)")
        await node.delete(sb.id)
    return xs


async def create_vs_cold(settings: Settings, creates: int, cold: int) -> dict[str, float]:
    res: dict[str, float] = {}
    async with Node(replace(settings, warm_low=0, warm_high=0)) as node:
        t0 = time.monotonic()
        first = await node.create("base", memory_mb=512)  # builds the template snapshot
        print(f"  template snapshot build + first create: {time.monotonic() - t0:.2f}s")
        await node.delete(first.id)
        xs = await _creates(node, creates, warm=False)
    res["restore_p50"], res["restore_p99"] = pct(xs, 50), pct(xs, 99)
    async with Node(settings) as node:
        await node.delete((await node.create("base", memory_mb=512)).id)  # the shape joins
        ws = await _creates(node, creates, warm=True)
    res["warm_p50"], res["warm_p99"] = pct(ws, 50), pct(ws, 99)
    ys = []
    async with Node(settings, snapshots=False) as node:
        for _ in range(cold):
            t0 = time.monotonic()
            sb = await node.create("base", memory_mb=512)
            ys.append(time.monotonic() - t0)
            await node.delete(sb.id)
    res["cold_p50"], res["cold_p99"] = pct(ys, 50), pct(ys, 99)
    print(
        f"create from template snapshot ({creates} runs): p50 {res['restore_p50']:.3f}s  "
        f"p99 {res['restore_p99']:.3f}s\n"
        f"create from a warm pool entry ({creates} runs): p50 {res['warm_p50']:.3f}s  "
        f"p99 {res['warm_p99']:.3f}s\n"
        f"cold boot of the same template ({cold} runs): p50 {res['cold_p50']:.2f}s  "
        f"p99 {res['cold_p99']:.2f}s\n"
        f"ratio cold/restore (p50): {res['cold_p50'] / res['restore_p50']:.1f}x, "
        f"cold/warm: {res['cold_p50'] / res['warm_p50']:.1f}x",
        flush=True,
    )
    return res


# Random bytes written in place, 1 MiB at a time, so the guest holds them only once.
DIRTY = (
    'setsid nohup python3 -c "import os,time; n={n}; b=bytearray(n); '
    "[b.__setitem__(slice(i, i + 1048576), os.urandom(min(1048576, n - i))) "
    "for i in range(0, n, 1048576)]; "
    "open('/tmp/dirty.ready','w').write('1'); time.sleep(1e9)\" >/dev/null 2>&1 &"
    " for i in $(seq 600); do test -e /tmp/dirty.ready && break; sleep 0.2; done;"
    " test -e /tmp/dirty.ready"
)


async def pause_resume(settings: Settings, sizes: Sequence[int], fracs: Sequence[float]) -> None:
    print(
        "pause / resume (s)  [first pause = RAM stream from a template clone; resume right "
        "after it waits for the background conversion or loads the stream; converted = the "
        "conversion finished first; next = state only]"
    )
    async with Node(settings) as node:
        for mem in sizes:
            for frac in fracs:
                row = []
                for settle_first in (False, True):
                    sb = await node.create("base", memory_mb=mem)
                    try:
                        await sh(sb, DIRTY.format(n=int(mem * MIB * frac)))
                        t0 = time.monotonic()
                        await node.pause(sb.id)
                        t1 = time.monotonic()
                        if settle_first:
                            await node.conversions.wait(sb.id)
                        t2 = time.monotonic()
                        sb = await node.resume(sb.id)
                        t3 = time.monotonic()
                        row.append((t1 - t0, t2 - t1, t3 - t2))
                        if settle_first:
                            t0 = time.monotonic()
                            await node.pause(sb.id)
                            t1 = time.monotonic()
                            sb = await node.resume(sb.id)
                            row.append((t1 - t0, 0.0, time.monotonic() - t1))
                        await sh(sb, "test -e /tmp/dirty.ready")
                    finally:
                        await node.delete(sb.id)
                (p1, _, r1), (_, conv, r2), (p3, _, r3) = row
                print(
                    f"  {mem:5d} MiB, {frac:4.0%} dirty: first pause {p1:.3f} resume {r1:.3f} | "
                    f"converted in {conv:.3f}, resume {r2:.3f} | next pause {p3:.3f} "
                    f"resume {r3:.3f}",
                    flush=True,
                )


async def forks(settings: Settings, counts: Sequence[int]) -> None:
    print("fork (one capture, N restores with identity)")
    async with Node(settings) as node:
        src = await node.create("base", memory_mb=512)
        try:
            await sh(src, "echo parent > /root/p")
            for n in counts:
                t0 = time.monotonic()
                kids = await node.fork(src.id, n)
                total = time.monotonic() - t0
                print(
                    f"  {n:3d} children: total {total:6.2f}s  per child {total / n:.3f}s",
                    flush=True,
                )
                for k in kids:
                    await node.delete(k.id)
        finally:
            await node.delete(src.id)


async def main_async(args: argparse.Namespace, settings: Settings) -> None:
    parts = set(args.parts.split(","))
    if "create" in parts:
        await create_vs_cold(settings, args.creates, args.cold)
    if "pause" in parts:
        await pause_resume(settings, [256] if args.quick else [256, 1024], [0.1, 0.5])
    if "fork" in parts:
        await forks(settings, [1, 8] if args.quick else [1, 8, 32])
    if "idle" not in parts:
        return
    before = read_pressure()
    print(f"idle memory: {args.idle} restored, {args.idle_cold} cold-booted", flush=True)
    rows = list(await membench.measure(settings, args.idle, args.touch, cold=False))
    rows += await membench.measure(settings, args.idle_cold, args.touch, cold=True)
    membench.report(rows, (before.total - before.available) / MIB, before.total / MIB)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--creates", type=int, default=20)
    ap.add_argument("--cold", type=int, default=3)
    ap.add_argument("--idle", type=int, default=20)
    ap.add_argument("--idle-cold", type=int, default=20)
    ap.add_argument("--touch", type=int, default=0, help="MiB of page cache each idle guest fills")
    ap.add_argument("--quick", action="store_true", help="fewer sizes and children")
    ap.add_argument("--parts", default="create,pause,fork,idle", help="comma-separated subset")
    args = ap.parse_args()
    base = Settings.from_env()
    with tempfile.TemporaryDirectory(prefix="aenv-bench-snap-") as tmp:
        settings = replace(base, home=Path(tmp) / "home")
        from agentenv.template import rootfs

        rootfs.ensure_base(settings, None)
        asyncio.run(main_async(args, settings))
    return 0


if __name__ == "__main__":
    sys.exit(main())
