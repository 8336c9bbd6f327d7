"""What a busy slot's gateway serves and enforces for its guest: the egress policy in force,
the DNS listener (`network.dns`), and the inspecting proxy (`network.inspect`) while the
policy names domains. One per slot a sandbox holds, owned by the slot pool."""

from __future__ import annotations

import ipaddress
import time
from collections.abc import Iterable

from agentenv.network import nft
from agentenv.network.dns import DnsForwarder, SlotDns
from agentenv.network.egress import OPEN, Egress
from agentenv.network.inspect import SlotInspector
from agentenv.network.slot import Slot, set_egress


class SlotGateway:
    def __init__(
        self,
        slot: Slot,
        forwarder: DnsForwarder,
        never: Iterable[ipaddress.IPv4Network],
    ) -> None:
        self.slot = slot
        self.egress: Egress = OPEN
        self._dns = SlotDns(
            slot.netns_path, str(slot.gateway_ip), forwarder, lambda: self.egress, self._learn
        )
        self._inspector: SlotInspector | None = None
        # Learned addresses and when (monotonic) the slot's set lets them go.
        self._learned: dict[ipaddress.IPv4Address, float] = {}
        self._never = (*never, *nft.ALWAYS_BLOCKED)

    async def start(self) -> None:
        await self._dns.start()

    async def apply(self, egress: Egress) -> None:
        """Make `egress` the policy: the slot's nft table, and the proxy it may need."""
        if egress.inspects and self._inspector is None:
            inspector = SlotInspector(
                self.slot.netns_path, str(self.slot.gateway_ip), lambda: self.egress, self._never
            )
            await inspector.start()
            self._inspector = inspector
        # The proxy and DNS read `self.egress` per connection and query: in force at once.
        self.egress = egress
        # A new table starts with an empty `learned` set.
        self._learned.clear()
        await set_egress(self.slot, egress)
        # A proxy no longer needed stays until the slot is released: nothing new is redirected
        # to it, and the connections it relays stay up, as established ones do under nft.

    async def _learn(self, addresses: dict[ipaddress.IPv4Address, int]) -> None:
        if not self.egress.allow_domains:
            return
        now = time.monotonic()
        # An address still allowed for more than half of its new lifetime needs no update:
        # repeated lookups of a name (every request of a client that does not cache) cost
        # no `nft` run.
        fresh = {
            ip: ttl for ip, ttl in addresses.items() if self._learned.get(ip, 0) < now + ttl / 2
        }
        if not fresh:
            return
        await nft.apply(self.slot.netns, nft.learn_command(fresh))
        for ip, ttl in fresh.items():
            self._learned[ip] = now + ttl

    @property
    def reusable(self) -> bool:
        """Whether the next guest of the slot can have this gateway as it is: open egress
        (nothing learned, no table of its own to drop) and no inspecting proxy."""
        return self.egress.open and self._inspector is None and not self._learned

    async def close(self) -> None:
        await self._dns.close()
        if self._inspector is not None:
            await self._inspector.close()
            self._inspector = None
