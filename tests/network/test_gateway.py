"""A busy slot's gateway for real (`network.gateway`): its DNS listener inside the slot's
namespace, the egress table it installs, the addresses it learns, and that releasing the
slot takes all of it away. The guest side is a process inside the namespace."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest
from resolver import TestResolver

from agentenv.config import NetworkPlan
from agentenv.network import Egress, SlotPool
from agentenv.network.dns import DnsForwarder
from agentenv.network.slot import Slot

# Slots made in this process: the per-test leak check runs around these.
pytestmark = pytest.mark.host

LOOKUP = """
import sys, dns.message, dns.query
q = dns.message.make_query(sys.argv[1], "A")
r = dns.query.{how}(q, "169.254.0.1", timeout=3)
print(dns.rcode.to_text(r.rcode()), *[rd.address for rr in r.answer for rd in rr])
"""


async def lookup(slot: Slot, name: str, how: str = "udp") -> str:
    proc = await asyncio.create_subprocess_exec(
        "ip",
        "netns",
        "exec",
        slot.netns,
        sys.executable,
        "-c",
        LOOKUP.format(how=how),
        name,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    async with asyncio.timeout(20):
        out, err = await proc.communicate()
    return (out or err).decode().strip().splitlines()[-1]


async def nft_table(slot: Slot) -> str:
    proc = await asyncio.create_subprocess_exec(
        "ip",
        "netns",
        "exec",
        slot.netns,
        "nft",
        "list",
        "table",
        "inet",
        "agentenv_egress",
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    async with asyncio.timeout(20):
        out, _ = await proc.communicate()
    return out.decode()


async def test_gateway_dns_policy_and_release() -> None:
    with TestResolver({"inet.test": ["198.51.100.2"], "other.test": ["198.51.100.130"]}) as r:
        pool = SlotPool(NetworkPlan(), dns=DnsForwarder([r.address], timeout_s=1))
        try:
            slot = await pool.acquire()
            assert await lookup(slot, "inet.test") == "NOERROR 198.51.100.2"
            assert await lookup(slot, "other.test", "tcp") == "NOERROR 198.51.100.130"
            assert await lookup(slot, "nope.test") == "NXDOMAIN"

            policy = Egress.of(deny_out=["0.0.0.0/0"], allow_out=["inet.test"])
            await pool.set_egress(slot, policy)
            table = await nft_table(slot)
            assert "redirect to :15080" in table and "set learned" in table
            assert "198.51.100.2" not in table
            assert await lookup(slot, "inet.test") == "NOERROR 198.51.100.2"
            table = await nft_table(slot)
            assert "198.51.100.2 timeout 1m30s" in table  # learned with the answer
            assert "198.51.100.130" not in table

            await pool.set_egress(slot, Egress(internet=False))
            assert await lookup(slot, "inet.test") == "REFUSED"
            assert "redirect" not in await nft_table(slot)

            await pool.release(slot)
            gone = await lookup(slot, "inet.test")
            assert "NOERROR" not in gone  # nothing listens any more
        finally:
            await pool.close()


async def test_a_reused_slot_keeps_an_open_gateway_and_drops_a_policy() -> None:
    """A released slot the pool keeps keeps its gateway when its egress was open (the next
    guest gets the same DNS listener); one that had a policy gets a fresh, open one."""
    with TestResolver({"inet.test": ["198.51.100.2"]}) as r:
        pool = SlotPool(NetworkPlan(), 0, 2, dns=DnsForwarder([r.address], timeout_s=1))
        try:
            slot = await pool.acquire()
            first = pool._gateways[slot.index]
            await pool.release(slot)
            again = await pool.acquire()
            assert again.index == slot.index and pool._gateways[again.index] is first
            assert await lookup(again, "inet.test") == "NOERROR 198.51.100.2"

            await pool.set_egress(again, Egress(internet=False))
            assert await lookup(again, "inet.test") == "REFUSED"
            await pool.release(again)
            third = await pool.acquire()
            assert third.index == slot.index and pool._gateways[third.index] is not first
            assert pool.egress(third) == Egress()
            assert await lookup(third, "inet.test") == "NOERROR 198.51.100.2"
        finally:
            await pool.close()


@pytest.mark.parametrize("policy", [Egress.of(deny_out=["*.bad.test", "203.0.113.0/24"])])
async def test_adopted_slot_gets_its_gateway_back(policy: Egress) -> None:
    with TestResolver({"x.bad.test": ["198.51.100.9"], "ok.test": ["198.51.100.2"]}) as r:
        first = SlotPool(NetworkPlan(), dns=DnsForwarder([r.address], timeout_s=1))
        slot = await first.acquire()
        try:
            await first.set_egress(slot, policy)
            # A second pool (a restarted server) takes the slot over with its policy.
            await first._close_gateway(slot)
            again = SlotPool(NetworkPlan(), dns=DnsForwarder([r.address], timeout_s=1))
            await again.adopt(slot, policy)
            try:
                assert await lookup(slot, "x.bad.test") == "NXDOMAIN"
                assert await lookup(slot, "ok.test") == "NOERROR 198.51.100.2"
                assert again.egress(slot) == policy
            finally:
                await again.close()
        finally:
            await first.close()


async def test_a_slot_reused_at_once_serves_dns_again() -> None:
    with TestResolver({"inet.test": ["198.51.100.2"]}) as r:
        pool = SlotPool(NetworkPlan(), low=0, high=1, dns=DnsForwarder([r.address]))
        try:
            first = await pool.acquire()
            await pool.set_egress(first, Egress.of(deny_out=["0.0.0.0/0"], allow_out=["x.test"]))
            await pool.release(first)  # kept idle, policy reset
            again = await pool.acquire()
            assert again.index == first.index
            assert await lookup(again, "inet.test") == "NOERROR 198.51.100.2"
            assert "agentenv_egress" not in await nft_table(again)
            await pool.release(again)
        finally:
            await pool.close()
