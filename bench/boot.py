"""Cold-boot benchmark: spawn → envd healthy, over N sandboxes booted one after another.

Also prints how long the guest artifacts took to build (recorded by the artifact cache when
they were built) and how long `setup` takes now: near zero on a warm cache, the full build with
--fresh-cache (a temporary cache dir: downloads Debian packages and runs debootstrap).

    .venv/bin/python bench/boot.py -n 5
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from agentenv.config import Settings
from agentenv.node.host import Node


def _fmt(xs: list[float]) -> str:
    return f"min {min(xs):6.2f}s  median {statistics.median(xs):6.2f}s  max {max(xs):6.2f}s"


def recorded_build_times(settings: Settings) -> dict[str, float | None]:
    from agentenv.template import artifacts, rootfs
    from agentenv.template.cache import ArtifactCache

    arts = artifacts.ensure_all(settings, None)
    cache = ArtifactCache(settings.cache)
    dirs: dict[str, Path | None] = {
        f"kernel ({arts.kernel_kind})": arts.kernel.parent,
        "initramfs": arts.initramfs.parent if arts.initramfs is not None else None,
        "tools layer": arts.tools_image.parent,
        "base rootfs": cache.lookup("rootfs-base", rootfs.base_inputs()),
    }
    out: dict[str, float | None] = {}
    for name, d in dirs.items():
        info = ArtifactCache.build_info(d) if d is not None else {}
        out[name] = info.get("build_seconds")
    return out


async def boot_runs(settings: Settings, n: int, cpu: int, memory_mb: int, mem_file: bool) -> None:
    spawn: list[float] = []
    create: list[float] = []
    async with Node(settings, mem_file=mem_file, snapshots=False) as node:
        print(
            f"accelerator: {node.accel.name} ({node.accel.reason}); guest RAM in a file: {mem_file}"
        )
        for i in range(n):
            sb = await node.create("base", cpu=cpu, memory_mb=memory_mb)
            spawn.append(sb.spawn_to_healthy_s)
            create.append(sb.boot_s)
            print(
                f"  run {i + 1}/{n}: spawn→healthy {sb.spawn_to_healthy_s:6.2f}s  "
                f"create() {sb.boot_s:6.2f}s",
                flush=True,
            )
            await node.delete(sb.id)
    print(f"cold boot, spawn → envd healthy ({n} runs): {_fmt(spawn)}")
    print(f"node.create() total ({n} runs):            {_fmt(create)}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", "--runs", type=int, default=5)
    ap.add_argument("--cpu", type=int, default=1)
    ap.add_argument("--memory", type=int, default=512)
    ap.add_argument("--mem-file", action="store_true", help="guest RAM in a shared file")
    ap.add_argument("--fresh-cache", action="store_true", help="time a full setup from scratch")
    args = ap.parse_args()
    if args.runs < 1:
        ap.error("--runs must be at least 1")

    base = Settings.from_env()
    with tempfile.TemporaryDirectory(prefix="aenv-bench-") as tmp:
        settings = replace(base, home=Path(tmp) / "home")
        if args.fresh_cache:
            settings = replace(settings, cache=Path(tmp) / "cache")
        t0 = time.monotonic()
        from agentenv.template import artifacts, rootfs

        artifacts.ensure_all(settings, None)
        t1 = time.monotonic()
        rootfs.ensure_base(settings, None)
        t2 = time.monotonic()
        cache_kind = "fresh" if args.fresh_cache else "warm"
        print(
            f"setup now ({cache_kind} cache): artifacts {t1 - t0:.2f}s, base rootfs {t2 - t1:.2f}s"
        )
        print("build times recorded in the cache:")
        for name, secs in recorded_build_times(settings).items():
            print(f"  {name:24s} {'not recorded' if secs is None else f'{secs:.1f}s'}")
        asyncio.run(boot_runs(settings, args.runs, args.cpu, args.memory, args.mem_file))
    return 0


if __name__ == "__main__":
    sys.exit(main())
