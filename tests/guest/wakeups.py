"""How often a process's threads wake: what an idle guest server costs under TCG."""

from __future__ import annotations

import time
from pathlib import Path


def wakeups(pid: int) -> int:
    """Voluntary context switches of every thread: each is a sleep the thread woke from."""
    total = 0
    for status in Path(f"/proc/{pid}/task").glob("*/status"):
        for line in status.read_text().splitlines():
            if line.startswith("voluntary_ctxt_switches:"):
                total += int(line.split()[1])
    return total


def wakeups_per_s(pid: int, over_s: float = 2.0) -> float:
    before, t0 = wakeups(pid), time.monotonic()
    time.sleep(over_s)
    return (wakeups(pid) - before) / (time.monotonic() - t0)
