"""A pool of ready network slots, refilled in the background between watermarks."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

from agentenv.config import NetworkPlan
from agentenv.network.slot import Slot, create_slot, destroy_slot, reset_slot


class SlotPool:
    """Hands out slots; keeps between `low` and `high` idle slots ready when `high` > 0.

    `acquire()` takes an idle slot if one is ready, else builds one (~40 ms). `release()`
    returns a slot to the pool (after a conntrack reset) while fewer than `high` are idle, and
    destroys it otherwise.
    """

    def __init__(
        self, plan: NetworkPlan, low: int = 0, high: int = 0, *, owner: Path | None = None
    ) -> None:
        if low < 0 or high < low:
            raise ValueError(f"slot pool watermarks need 0 <= low <= high, got {low}, {high}")
        self.plan = plan
        # The data dir's slot markers (`network.slot.create_slot`).
        self.owner = owner
        self.low = low
        self.high = high
        self._idle: list[Slot] = []
        self._busy: dict[int, Slot] = {}
        self._refill: asyncio.Task[None] | None = None
        self._closed = False

    @property
    def idle(self) -> int:
        return len(self._idle)

    @property
    def busy(self) -> list[Slot]:
        return list(self._busy.values())

    async def start(self) -> None:
        """Fill up to the high watermark before returning."""
        while len(self._idle) < self.high:
            self._idle.append(await create_slot(self.plan, owner=self.owner))

    async def acquire(self) -> Slot:
        if self._closed:
            raise RuntimeError("slot pool is closed")
        slot = self._idle.pop(0) if self._idle else await create_slot(self.plan, owner=self.owner)
        self._busy[slot.index] = slot
        self._maybe_refill()
        return slot

    def adopt(self, slot: Slot) -> None:
        """A slot a VM of an earlier server still uses (crash recovery) counts as busy."""
        self._busy[slot.index] = slot

    async def release(self, slot: Slot) -> None:
        self._busy.pop(slot.index, None)
        if not self._closed and len(self._idle) < self.high:
            try:
                await reset_slot(slot)
            except Exception:
                await destroy_slot(slot, owner=self.owner)
                raise
            self._idle.append(slot)
        else:
            await destroy_slot(slot, owner=self.owner)

    def _maybe_refill(self) -> None:
        if self._closed or len(self._idle) >= self.low or self.high == 0:
            return
        if self._refill is None or self._refill.done():
            self._refill = asyncio.create_task(self._fill())

    async def _fill(self) -> None:
        while not self._closed and len(self._idle) < self.high:
            slot = await create_slot(self.plan, owner=self.owner)
            if self._closed:
                await destroy_slot(slot, owner=self.owner)
                return
            self._idle.append(slot)

    async def close(self) -> None:
        """Destroy every slot, idle or busy (callers stop their VMs first)."""
        self._closed = True
        if self._refill is not None:
            self._refill.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._refill
        slots = self._idle + list(self._busy.values())
        self._idle.clear()
        self._busy.clear()
        for slot in slots:
            await destroy_slot(slot, owner=self.owner)
