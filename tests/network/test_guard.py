"""A slot's guard against a guest that forges its identity, its rate limits and its cap on
connections: the generated rules, and the rules on a real slot fed frames through its tap
(no VM: the test writes into the tap what a guest would send)."""

from __future__ import annotations

import asyncio
import ipaddress
import json
import subprocess
import sys
from collections.abc import AsyncIterator
from dataclasses import replace

import pytest
from pyroute2 import AsyncIPRoute

from agentenv.config import NetworkPlan, Settings
from agentenv.config_env import ConfigError
from agentenv.network import NetworkError, create_slot, destroy_slot, nft, slot_for
from agentenv.network.slot import (
    Slot,
    conntrack_entries,
    guard_counters,
    reset_slot,
    shape_parameters,
)

from .tapwire import (
    ETH_IPV6,
    ETH_VLAN,
    arp_replies,
    arp_request,
    ether,
    udp_packet,
    wire,
)

# Slots made in this process: the per-test leak check runs around these.
pytestmark = pytest.mark.host

GUEST_IP = "169.254.0.2"
GATEWAY_IP = "169.254.0.1"
OTHER_MAC = "02:ae:00:00:00:03"


def test_guard_rules_name_the_guest_and_police_only_with_a_rate() -> None:
    rules = nft.guard_ruleset(
        tap="tap0",
        guest_mac="02:ae:00:00:00:02",
        guest_ip=ipaddress.IPv4Address(GUEST_IP),
        rate_bytes=2_500_000,
    )
    assert "table netdev agentenv_guard" in rules
    assert 'hook ingress device "tap0"' in rules and "policy drop" in rules
    assert "ether saddr != 02:ae:00:00:00:02" in rules
    assert "arp saddr ether != 02:ae:00:00:00:02" in rules
    assert f"arp saddr ip != {GUEST_IP}" in rules and f"ip saddr != {GUEST_IP}" in rules
    assert "ether type != { ip, arp }" in rules
    assert "limit rate over 2500000 bytes/second" in rules
    for name in nft.GUARD_COUNTERS:
        assert f"counter {name} {{" in rules
    off = nft.guard_ruleset(
        tap="tap0", guest_mac="02:ae:00:00:00:02", guest_ip=ipaddress.IPv4Address(GUEST_IP)
    )
    assert "limit" not in off and "ip saddr !=" in off


def _slot_rules(max_connections: int) -> str:
    return nft.slot_ruleset(
        veth="ae-n0",
        tap="tap0",
        slot_ip=ipaddress.IPv4Address("198.18.0.2"),
        guest_ip=ipaddress.IPv4Address(GUEST_IP),
        gateway_ip=ipaddress.IPv4Address(GATEWAY_IP),
        blocked=[ipaddress.IPv4Network("198.18.0.0/15")],
        max_connections=max_connections,
    )


def test_connection_cap_is_one_count_for_both_hooks() -> None:
    rules = _slot_rules(200)
    assert rules.count("ct count over 200") == 1
    # Forwarded and local (gateway) connections of the guest both pass the one count.
    assert rules.count('iifname "tap0" ct state new jump guest_new') == 2
    assert "reject with tcp reset" in rules.split("chain refuse")[1].split("}")[0]
    assert "ct count" not in _slot_rules(0) and "guest_new" not in _slot_rules(0)


def test_shaper_parameters() -> None:
    slot = replace(slot_for(NetworkPlan(), 0), rate_mbit=200)
    params = shape_parameters(slot)
    assert params == {"rate": "200mbit", "burst": 250_000, "latency": "50ms"}
    small = shape_parameters(replace(slot, rate_mbit=1))
    assert small is not None and small["burst"] == 64 * 1024
    assert shape_parameters(replace(slot, rate_mbit=0)) is None


def test_limits_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    net = Settings.from_env().network
    assert (net.rate_mbit, net.max_connections) == (200, 4096)
    monkeypatch.setenv("AGENTENV_NET_RATE_MBIT", "20")
    monkeypatch.setenv("AGENTENV_SLOT_MAX_CONNECTIONS", "0")
    net = Settings.from_env().network
    assert (net.rate_mbit, net.max_connections) == (20, 0)
    assert slot_for(net, 3).rate_mbit == 20
    for name, bad in (
        ("AGENTENV_NET_RATE_MBIT", "-1"),
        ("AGENTENV_NET_RATE_MBIT", "fast"),
        ("AGENTENV_NET_RATE_MBIT", "40000"),
        ("AGENTENV_SLOT_MAX_CONNECTIONS", "-5"),
    ):
        monkeypatch.setenv(name, bad)
        with pytest.raises(ConfigError, match=name):
            Settings.from_env()
        monkeypatch.delenv(name)


PLAN = replace(NetworkPlan(), rate_mbit=1, max_connections=50)


@pytest.fixture
async def slot() -> AsyncIterator[Slot]:
    made = await create_slot(PLAN)
    try:
        yield made
    finally:
        await destroy_slot(made)


def _sh(*argv: str) -> str:
    return subprocess.run(argv, capture_output=True, text=True, check=True).stdout


async def _guarded(slot: Slot, frames: list[bytes]) -> list[bytes]:
    return await asyncio.to_thread(wire, slot.netns, frames)


def _neighbours(slot: Slot) -> str:
    return _sh("ip", "-n", slot.netns, "neigh", "show", "dev", slot.tap)


async def test_forged_frames_are_dropped_and_counted(slot: Slot) -> None:
    mac = slot.guest_mac
    before = await guard_counters(slot)
    assert set(before) == set(nft.GUARD_COUNTERS) and not any(before.values())
    # The guest as itself: the gateway answers its ARP.
    got = await _guarded(slot, [arp_request(mac, mac, GUEST_IP, GATEWAY_IP)])
    assert arp_replies(got, GATEWAY_IP)
    assert not any((await guard_counters(slot)).values())

    forged = [
        # Another slot's or the gateway's MAC as the frame's source.
        arp_request(OTHER_MAC, OTHER_MAC, GUEST_IP, GATEWAY_IP),
        udp_packet(mac, OTHER_MAC, GUEST_IP, GATEWAY_IP, 1000, 53),
        # Right frame source, ARP claiming another MAC or another IP (the gateway's, .3),
        # or not Ethernet/IPv4 ARP at all.
        arp_request(mac, OTHER_MAC, GUEST_IP, GATEWAY_IP),
        arp_request(mac, mac, GATEWAY_IP, GATEWAY_IP),
        arp_request(mac, mac, "169.254.0.3", GATEWAY_IP),
        arp_request(mac, mac, GUEST_IP, GATEWAY_IP, htype=6),
        # IPv4 from another address.
        udp_packet(mac, mac, "169.254.0.3", GATEWAY_IP, 1000, 53),
        udp_packet(mac, mac, "198.18.0.6", GATEWAY_IP, 1000, 53),
        # Other protocols, tagged frames.
        ether("33:33:00:00:00:01", mac, ETH_IPV6, b"\x60" + b"\0" * 39),
        ether("ff:ff:ff:ff:ff:ff", mac, ETH_VLAN, b"\0\x05\x08\x06" + b"\0" * 28),
    ]
    got = await _guarded(slot, forged)
    assert not arp_replies(got, GATEWAY_IP), "a forged ARP was answered"
    counts = await guard_counters(slot)
    assert counts == {
        "spoof_mac": 2,
        "spoof_arp": 4,
        "spoof_ip": 2,
        "other_proto": 2,
        "over_rate": 0,
    }
    # Nothing the forgeries claimed made it into the gateway's neighbour table.
    neigh = await asyncio.to_thread(_neighbours, slot)
    assert OTHER_MAC not in neigh and "169.254.0.3" not in neigh

    # A reused slot starts from zero and is still guarded.
    await reset_slot(slot)
    assert not any((await guard_counters(slot)).values())
    await _guarded(slot, forged[:1])
    assert (await guard_counters(slot))["spoof_mac"] == 1

    # Not while a process still holds the tap (a QEMU the kernel did not let die): the
    # next guest could not open it.
    holder = await asyncio.create_subprocess_exec(
        "ip", "netns", "exec", slot.netns, sys.executable, "-c", _HOLD_TAP, slot.tap,
        stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        assert holder.stdout is not None
        assert await asyncio.wait_for(holder.stdout.readline(), 30) == b"attached\n"
        with pytest.raises(NetworkError, match="still held"):
            await reset_slot(slot)
    finally:
        holder.kill()
        await holder.wait()
    await reset_slot(slot)


# Attaches to the tap named by argv[1] as QEMU would and keeps it until killed.
_HOLD_TAP = """
import fcntl, os, struct, sys, time
fd = os.open("/dev/net/tun", os.O_RDWR)
fcntl.ioctl(fd, 0x400454CA, struct.pack("16sH", sys.argv[1].encode(), 0x0002 | 0x1000))
print("attached", flush=True)
time.sleep(60)
"""


async def test_what_the_guest_sends_is_policed_and_what_it_gets_shaped(slot: Slot) -> None:
    # 1 Mbit/s: 125 kB/s, and the bucket holds one second of it. 1000 frames of ~1.4 kB
    # written at once are 1.4 MB: most must be dropped.
    mac = slot.guest_mac
    frames = [
        udp_packet(mac, mac, GUEST_IP, GATEWAY_IP, 2000 + i % 1000, 9, size=1372)
        for i in range(1000)
    ]
    await _guarded(slot, frames)
    counts = await guard_counters(slot)
    assert 800 <= counts["over_rate"] <= 960, counts
    assert counts["spoof_ip"] == counts["spoof_mac"] == 0
    async with AsyncIPRoute(netns=slot.netns) as ipr:
        tap = (await ipr.link_lookup(ifname=slot.tap))[0]
        qdiscs = [q async for q in await ipr.get_qdiscs(tap)]
    tbf = [q for q in qdiscs if q.get_attr("TCA_KIND") == "tbf"]
    assert len(tbf) == 1
    assert tbf[0].get_attr("TCA_OPTIONS").get_attr("TCA_TBF_PARMS")["rate"] == 125_000


async def test_guest_connections_beyond_the_cap_are_refused(slot: Slot) -> None:
    # UDP "connections" to the gateway's DNS port (nothing listens: each is answered with
    # port unreachable, and stays tracked for its timeout). The cap is 50.
    mac = slot.guest_mac
    ns = ("ip", "-n", slot.netns)
    await asyncio.to_thread(_sh, *ns, "neigh", "replace", GUEST_IP, "lladdr", mac, "dev", "tap0")
    link = await asyncio.to_thread(_sh, "ip", "-j", "-n", slot.netns, "link", "show", "tap0")
    gateway_mac = json.loads(link)[0]["address"]
    frames = [udp_packet(gateway_mac, mac, GUEST_IP, GATEWAY_IP, 3000 + i, 53) for i in range(80)]
    await asyncio.to_thread(wire, slot.netns, frames)
    refused = (await nft.counters(slot.netns, "inet", nft.TABLE))[nft.OVER_CAP]
    assert refused == 30
    tracked = await conntrack_entries(slot)
    assert 50 <= tracked <= 52, tracked
    # Refusals come back at once, as ICMP admin-prohibited (type 3 code 13). The kernel
    # sends a peer a handful of ICMP errors a second: after a pause, one more is refused.
    await asyncio.sleep(1.5)
    one = [udp_packet(gateway_mac, mac, GUEST_IP, GATEWAY_IP, 4000, 53)]
    got = await asyncio.to_thread(wire, slot.netns, one)
    icmp = [f for f in got if f[12:14] == b"\x08\x00" and f[23] == 1]
    assert [(f[34], f[35]) for f in icmp] == [(3, 13)], [f.hex() for f in got]
