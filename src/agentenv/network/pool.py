"""A pool of ready network slots, refilled in the background between watermarks; each slot
it hands out gets its gateway (`network.gateway`: DNS, egress policy, inspecting proxy)."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

from agentenv.config import NetworkPlan
from agentenv.network.dns import DnsForwarder
from agentenv.network.egress import Egress
from agentenv.network.gateway import SlotGateway
from agentenv.network.slot import (
    Slot,
    apply_guard,
    create_slot,
    destroy_slot,
    forget_connections,
    mark_pooled,
    reset_slot,
    set_egress,
)


class SlotPool:
    """Hands out slots; keeps between `low` and `high` idle slots ready when `high` > 0.

    `acquire()` takes an idle slot if one is ready, else builds one (~15 ms of CPU, ~50 ms).
    `release()` returns a slot to the pool (`reset_slot`: ~0.5 ms, ~1.8 with a conntrack
    flush) while fewer than `high` are idle, and destroys it otherwise. `start()` builds
    `low` ahead.
    """

    def __init__(
        self,
        plan: NetworkPlan,
        low: int = 0,
        high: int = 0,
        *,
        owner: Path | None = None,
        dns: DnsForwarder | None = None,
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
        # Without a forwarder (tests of the pool alone) slots get no gateway: no DNS, and
        # policies are nft rules only.
        self.dns = dns
        self._gateways: dict[int, SlotGateway] = {}
        # Slots that may hold an egress table (a policy other than the open one was set):
        # a reuse removes it; the others have none to remove.
        self._restricted: set[int] = set()
        # Idle or busy slots that still track connections a guest before the current one
        # left (`reset_slot` keeps a few after an open guest): forgotten before a guest of
        # another policy runs there.
        self._stale: set[int] = set()
        self._refill: asyncio.Task[None] | None = None
        self._closed = False

    @property
    def idle(self) -> int:
        return len(self._idle)

    @property
    def busy(self) -> list[Slot]:
        return list(self._busy.values())

    async def start(self) -> None:
        """Build up to the low watermark before returning (the rest come back from
        releases)."""
        while len(self._idle) < self.low:
            self._pooled(await create_slot(self.plan, owner=self.owner))

    async def acquire(self) -> Slot:
        if self._closed:
            raise RuntimeError("slot pool is closed")
        if self._idle:
            slot = self._idle.pop(0)
            mark_pooled(self.owner, slot, False)
        else:
            slot = await create_slot(self.plan, owner=self.owner)
            self._stale.discard(slot.index)  # of an earlier slot with this index
        self._busy[slot.index] = slot
        self._maybe_refill()
        try:
            await self._open_gateway(slot)
        except BaseException:
            await self.release(slot)
            raise
        return slot

    async def adopt(self, slot: Slot, egress: Egress) -> None:
        """A slot a VM of an earlier server still uses (crash recovery) counts as busy; its
        gateway comes back with the policy its nft table still holds. Its guard is rebuilt
        with this server's limits (counters from zero)."""
        self._busy[slot.index] = slot
        if not egress.open:
            self._restricted.add(slot.index)
        await apply_guard(slot)
        await self._open_gateway(slot)
        gateway = self._gateways.get(slot.index)
        if gateway is not None:
            await gateway.apply(egress)

    async def _open_gateway(self, slot: Slot) -> None:
        if self.dns is None or slot.index in self._gateways:
            return
        gateway = SlotGateway(slot, self.dns, [self.plan.slot_cidr])
        await gateway.start()
        self._gateways[slot.index] = gateway

    async def set_egress(self, slot: Slot, egress: Egress, *, running: bool = False) -> None:
        """Where the guest on a busy `slot` may open connections; at once, also while it runs
        (connections it already has stay). Before its guest runs (not `running`), a policy
        other than the open one also makes the slot forget what an earlier guest left
        tracked; for a guest that runs, those count as its own (it had the same address
        and the open policy until now)."""
        if not egress.open:
            self._restricted.add(slot.index)
        gateway = self._gateways.get(slot.index)
        if gateway is not None:
            await gateway.apply(egress)
        else:
            await set_egress(slot, egress)
        if not egress.open and not running and slot.index in self._stale:
            # After the policy holds: nothing the guest sends in between is judged by the
            # open one.
            await forget_connections(slot)
            self._stale.discard(slot.index)

    def egress(self, slot: Slot) -> Egress | None:
        gateway = self._gateways.get(slot.index)
        return None if gateway is None else gateway.egress

    async def _close_gateway(self, slot: Slot) -> None:
        gateway = self._gateways.pop(slot.index, None)
        if gateway is not None:
            await gateway.close()

    async def release(self, slot: Slot) -> None:
        self._busy.pop(slot.index, None)
        restricted = slot.index in self._restricted
        self._restricted.discard(slot.index)
        kept = not self._closed and len(self._idle) < self.high
        gateway = self._gateways.get(slot.index)
        # A kept slot of open egress keeps its gateway (its DNS socket in the slot's
        # namespace) for the next guest: closing and opening it again was ~0.4 ms of a
        # kill and a create. Anything with a policy starts afresh.
        if not kept or restricted or (gateway is not None and not gateway.reusable):
            await self._close_gateway(slot)
        self._stale.discard(slot.index)
        if kept:
            try:
                stale = await reset_slot(slot, egress_open=not restricted)
            except Exception:
                await self._close_gateway(slot)
                await destroy_slot(slot, owner=self.owner)
                raise
            if stale:
                self._stale.add(slot.index)
            self._pooled(slot)
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
            self._pooled(slot)

    def _pooled(self, slot: Slot) -> None:
        # A marker write (~10 µs, a local file): on the loop, no thread hop for it.
        mark_pooled(self.owner, slot, True)
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
            await self._close_gateway(slot)
            await destroy_slot(slot, owner=self.owner)
