"""Where a data dir's network slots stand, read from the host: held by a VM (its record names
the slot's namespace), waiting in the server's slot pool (reset for reuse), or neither (left
behind). Used by the benches' leak checks (`abuse`, `churn`)."""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass
from pathlib import Path

from agentenv.config import NetworkPlan
from agentenv.network import slot_for
from agentenv.network.slot import NETNS_PREFIX, conntrack_entries, guard_counters
from agentenv.vmm import registry


def pooled(netns: str) -> bool:
    """The slot was reset for reuse (`network.slot.reset_slot`): its guard's counters are at
    zero and its namespace tracks no connection (a released guest's, and the proxy's to its
    envd, are flushed by the reset)."""
    index = netns.removeprefix(NETNS_PREFIX)
    if not index.isdigit():
        return False
    slot = slot_for(NetworkPlan(), int(index))

    async def reset() -> bool:
        counts = await guard_counters(slot)
        return not any(counts.values()) and await conntrack_entries(slot) == 0

    try:
        return asyncio.run(reset())
    except Exception:
        return False


@dataclass(frozen=True)
class SlotCensus:
    pooled: int
    stray: list[str]


def census(home: Path) -> SlotCensus:
    """The data dir's slots (its markers that name an existing namespace) that no VM holds:
    reset and waiting in the pool, or left behind (stray)."""
    existing = set(os.listdir("/run/netns")) if os.path.isdir("/run/netns") else set()
    markers = home / "run" / "slots"
    ours = existing & set(os.listdir(markers)) if markers.is_dir() else set()
    named = {(r.spec or {}).get("netns") for r in registry.load_all(home / "run" / "vms")}
    idle = sorted(ours - named)
    stray = [n for n in idle if not pooled(n)]
    return SlotCensus(pooled=len(idle) - len(stray), stray=stray)
