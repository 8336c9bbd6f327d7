"""Where a data dir's network slots stand, read from the host: held by a VM (its record names
the slot's namespace), waiting in the server's slot pool (reset for reuse), or neither (left
behind). Used by the benches' leak checks (`abuse`, `churn`)."""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass
from pathlib import Path

from agentenv.config import NetworkPlan
from agentenv.network import conntrack, slot_for
from agentenv.network.slot import NETNS_PREFIX, conntrack_entries, guard_counters, is_pooled
from agentenv.vmm import registry


def pooled(home: Path, netns: str) -> bool:
    """The slot waits in its server's pool: its marker says so (`network.slot.mark_pooled`)
    and it was reset (`network.slot.reset_slot`): its guard's counters are at zero and its
    namespace tracks no more connections than a reset keeps."""
    index = netns.removeprefix(NETNS_PREFIX)
    if not index.isdigit() or not is_pooled(home / "run" / "slots", netns):
        return False
    slot = slot_for(NetworkPlan(), int(index))

    async def reset() -> bool:
        counts = await guard_counters(slot)
        kept = conntrack.stale_allowed(slot.max_connections)
        return not any(counts.values()) and await conntrack_entries(slot) <= kept

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
    stray = [n for n in idle if not pooled(home, n)]
    return SlotCensus(pooled=len(idle) - len(stray), stray=stray)
