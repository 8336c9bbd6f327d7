"""Guest resource usage for `GET /metrics`, read from /proc and statvfs."""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any


def _cpu_times() -> tuple[int, int]:
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return sum(fields[:8]), idle


def _meminfo() -> dict[str, int]:
    values: dict[str, int] = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, _, rest = line.partition(":")
            parts = rest.split()
            if parts:
                values[key] = int(parts[0]) * 1024
    return values


async def collect(sample_seconds: float = 0.1) -> dict[str, Any]:
    total0, idle0 = _cpu_times()
    await asyncio.sleep(sample_seconds)
    total1, idle1 = _cpu_times()
    busy = (total1 - total0) - (idle1 - idle0)
    cpu_pct = 100.0 * busy / (total1 - total0) if total1 > total0 else 0.0
    mem = _meminfo()
    mem_total = mem.get("MemTotal", 0)
    mem_available = mem.get("MemAvailable", mem.get("MemFree", 0))
    disk = os.statvfs("/")
    disk_total = disk.f_blocks * disk.f_frsize
    disk_used = (disk.f_blocks - disk.f_bfree) * disk.f_frsize
    return {
        "ts": int(time.time()),
        "cpu_count": os.cpu_count() or 1,
        "cpu_used_pct": round(cpu_pct, 2),
        "mem_total": mem_total,
        "mem_used": mem_total - mem_available,
        "mem_cache": mem.get("Cached", 0),
        "mem_total_mib": mem_total // (1024 * 1024),
        "mem_used_mib": (mem_total - mem_available) // (1024 * 1024),
        "disk_total": disk_total,
        "disk_used": disk_used,
    }
