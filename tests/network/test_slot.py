"""Network slots built for real: namespaces, veths, taps and nftables on this host."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import subprocess
import sys
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
from pyroute2 import netns

from agentenv.config import GATEWAY_MAC, NetworkPlan
from agentenv.network import (
    NetworkError,
    NoFreeSlot,
    SlotPool,
    cleanup_stale,
    conntrack,
    create_slot,
    destroy_slot,
    marked_slot,
    netns_socket,
    recover_slots,
    slot_for,
)
from agentenv.network import slot as slot_module
from agentenv.network.egress import Egress
from agentenv.network.slot import Slot, conntrack_entries, host_lock, is_pooled, made_here
from agentenv.vmm.confine import vm_ids

# Slots made in this process: the per-test leak check runs around these.
pytestmark = pytest.mark.host


def sh(*argv: str) -> str:
    return subprocess.run(argv, capture_output=True, text=True, check=True).stdout


def host_links() -> dict[str, int]:
    return {d["ifname"]: d["ifindex"] for d in json.loads(sh("ip", "-j", "link"))}


async def host_table_matches_slots() -> bool:
    """The host table exists exactly while some slot (ours or another server's) exists. Read
    under the host lock: other servers and test sessions on this host add and remove slots."""
    async with host_lock("test: host table check"):
        has_slots = any(n.startswith("ae-h") for n in host_links())
        return ("inet agentenv" in sh("nft", "list", "tables")) == has_slots


async def assert_released(slot: Slot, host_ifindex: int) -> None:
    """The slot's links and namespace are gone. Checked under the host lock, and by what is
    unique to this slot: another process on the host may already have taken its index again,
    and then a namespace of the same name is that process's complete slot, with its own host
    veth (interface indexes are not reused)."""
    async with host_lock("test: slot release check"):
        links = host_links()
        assert host_ifindex not in links.values()
        assert not made_here(slot.netns)
        if slot.netns in netns.listnetns():
            assert links.get(slot.host_veth, host_ifindex) != host_ifindex, slot


def ns_links(netns: str) -> dict[str, dict[str, object]]:
    data = json.loads(sh("ip", "-j", "-n", netns, "addr"))
    return {d["ifname"]: d for d in data}


def test_address_plan_is_per_slot_outside_and_identical_inside() -> None:
    plan = NetworkPlan()
    s0, s5 = slot_for(plan, 0), slot_for(plan, 5)
    assert (str(s0.host_ip), str(s0.slot_ip)) == ("198.18.0.1", "198.18.0.2")
    assert (str(s5.host_ip), str(s5.slot_ip)) == ("198.18.0.21", "198.18.0.22")
    assert (s0.guest_ip, s0.gateway_ip, s0.guest_mac) == (s5.guest_ip, s5.gateway_ip, s5.guest_mac)
    assert str(s0.guest_ip) == "169.254.0.2"
    last = slot_for(plan, plan.max_slots - 1)
    assert str(last.slot_ip) == "198.19.255.254"
    with pytest.raises(NoFreeSlot):
        slot_for(plan, plan.max_slots)


async def test_create_and_destroy_slot() -> None:
    plan = NetworkPlan()
    slot = await create_slot(plan)
    host_ifindex = host_links()[slot.host_veth]
    try:
        assert slot.netns in sh("ip", "netns", "list")
        links = ns_links(slot.netns)
        assert set(links) == {"lo", slot.ns_veth, "tap0"}
        addrs = {a["local"] for a in links["tap0"]["addr_info"]}  # type: ignore[attr-defined]
        assert addrs == {"169.254.0.1"}
        ns_addrs = {a["local"] for a in links[slot.ns_veth]["addr_info"]}  # type: ignore[attr-defined]
        assert str(slot.slot_ip) in ns_addrs
        host = json.loads(sh("ip", "-j", "addr", "show", "dev", slot.host_veth))[0]
        assert {a["local"] for a in host["addr_info"]} == {str(slot.host_ip)}
        rules = sh("ip", "netns", "exec", slot.netns, "nft", "list", "table", "inet", "agentenv")
        assert f"ip daddr {slot.slot_ip} dnat ip to 169.254.0.2" in rules
        assert "masquerade" in rules
        assert "inet agentenv" in sh("nft", "list", "tables")
        fwd = sh("ip", "netns", "exec", slot.netns, "cat", "/proc/sys/net/ipv4/ip_forward")
        assert fwd.strip() == "1"
        # The tap is the slot's VM uid's: no other unprivileged process may attach to it.
        uid, gid = vm_ids("any", slot.netns)
        owner = sh("ip", "netns", "exec", slot.netns, "cat", "/sys/class/net/tap0/owner")
        group = sh("ip", "netns", "exec", slot.netns, "cat", "/sys/class/net/tap0/group")
        assert (int(owner), int(group)) == (uid, gid) and uid != 0
        # As a confined QEMU does: /dev/net/tun opened (its jail's node is 0666), then the
        # attach as its uid, with no capabilities left.
        attach = (
            "import fcntl, os, struct, sys\n"
            "fd = os.open('/dev/net/tun', os.O_RDWR)\n"
            "who = int(sys.argv[1])\n"
            "os.setgroups([]); os.setresgid(who, who, who); os.setresuid(who, who, who)\n"
            "try:\n"
            "    fcntl.ioctl(fd, 0x400454CA, struct.pack('16sH', b'tap0', 0x0002 | 0x1000))\n"
            "    print('attached')\n"
            "except OSError as e:\n"
            "    print(e.errno)\n"
        )
        for who, expected in ((uid + 1, "1"), (uid, "attached")):  # 1 = EPERM
            got = sh(
                "ip", "netns", "exec", slot.netns, sys.executable, "-c", attach, str(who)
            )  # fmt: skip
            assert got.strip() == expected, (who, got)
    finally:
        await destroy_slot(slot)
    await assert_released(slot, host_ifindex)
    assert await host_table_matches_slots()


async def test_a_failed_veth_delete_still_removes_the_namespace(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A failure of the host-side netlink step that is not the kernel's answer (a closed
    socket, a library error) must not leave the namespace: deleting it takes the veth pair
    and the tap with it. A fault injected where a real netlink socket would not fail."""
    slot = await create_slot(NetworkPlan())
    host_ifindex = host_links()[slot.host_veth]

    class Broken:
        def __enter__(self) -> Broken:
            raise RuntimeError("netlink session broke")

        def __exit__(self, *exc: object) -> None:
            return None

    with monkeypatch.context() as m:
        m.setattr("agentenv.network.slot.IPRoute", lambda *a, **k: Broken())
        await destroy_slot(slot)
    assert not made_here(slot.netns)
    for _ in range(150):  # the kernel's namespace cleanup takes the pair a moment later
        if host_ifindex not in host_links().values():
            break
        await asyncio.sleep(0.02)
    await assert_released(slot, host_ifindex)
    assert await host_table_matches_slots()


async def test_the_loop_runs_while_a_slot_is_removed(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel removes a veth inside the netlink request (tens of ms, RCU grace periods
    under the rtnl lock), so the server's loop must not make that request. The delete is
    held until the loop has run a callback, which it cannot do if the delete runs on it
    (pyroute2's blocking socket also refuses to run on a thread whose loop runs)."""
    from agentenv.network import slot as slot_mod

    slot = await create_slot(NetworkPlan())
    host_ifindex = host_links()[slot.host_veth]
    loop = asyncio.get_running_loop()
    real = slot_mod._delete_host_veth
    ran = threading.Event()
    seen: list[bool] = []

    def held_delete(name: str) -> None:
        real(name)
        loop.call_soon_threadsafe(ran.set)
        seen.append(ran.wait(timeout=5))

    monkeypatch.setattr(slot_mod, "_delete_host_veth", held_delete)
    await destroy_slot(slot)
    assert seen == [True]
    await assert_released(slot, host_ifindex)


async def test_the_host_table_is_replaced_only_when_it_lists_otherwise(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A new slot leaves the host table alone while it lists as this process applied it
    (replacing it waits out RCU grace periods under the host lock), and replaces it when it
    does not: here, a rule added by hand that matches nothing."""
    from agentenv.network import nft

    applied: list[str] = []
    real = nft.nft_run
    host = {nft.host_ruleset(slots_only=owned) for owned in (False, True)}

    def counting(text: str, *, json_output: bool = False) -> str:
        if text in host:
            applied.append(text)
        return real(text, json_output=json_output)

    monkeypatch.setattr(nft, "nft_run", counting)
    plan = NetworkPlan()
    slots = [await create_slot(plan)]
    try:
        applied.clear()
        slots.append(await create_slot(plan))
        assert applied == []
        stray = 'iifname "ae-hzz" counter'
        async with host_lock("test: a stray host rule"):
            sh("nft", "add", "rule", "inet", "agentenv", "input", *stray.split())
        assert stray in sh("nft", "list", "table", "inet", "agentenv")
        slots.append(await create_slot(plan))
        assert len(applied) == 1
        assert stray not in sh("nft", "list", "table", "inet", "agentenv")
    finally:
        for slot in slots:
            await destroy_slot(slot)
    assert await host_table_matches_slots()


async def test_two_slots_get_distinct_addresses_and_same_inside() -> None:
    plan = NetworkPlan()
    a = await create_slot(plan)
    try:
        b = await create_slot(plan)
        try:
            assert a.index != b.index and a.slot_ip != b.slot_ip
            for s in (a, b):
                tap = ns_links(s.netns)["tap0"]
                assert [x["local"] for x in tap["addr_info"]] == ["169.254.0.1"]  # type: ignore[index]
                # The gateway's MAC too: a restored guest's ARP cache holds the one its
                # snapshot was taken behind.
                assert tap["address"] == GATEWAY_MAC
            with pytest.raises(NetworkError, match="already in use"):
                await create_slot(plan, a.index)
        finally:
            await destroy_slot(b)
        # The host table stays while a slot remains.
        assert "inet agentenv" in sh("nft", "list", "tables")
    finally:
        await destroy_slot(a)
    assert await host_table_matches_slots()


async def test_custom_plan_is_honoured() -> None:
    plan = NetworkPlan(slot_cidr=ipaddress.IPv4Network("198.19.0.0/16"))
    slot = await create_slot(plan)
    try:
        base = ipaddress.IPv4Address("198.19.0.0") + 4 * slot.index
        assert (slot.host_ip, slot.slot_ip) == (base + 1, base + 2)
    finally:
        await destroy_slot(slot)


async def test_exhausted_range_raises() -> None:
    # Two slots in this range; other servers on the host may already hold some indexes.
    plan = NetworkPlan(slot_cidr=ipaddress.IPv4Network("198.19.128.0/29"))
    assert plan.max_slots == 2
    made = []
    try:
        with pytest.raises(NoFreeSlot, match="no free slot"):
            for _ in range(3):
                made.append(await create_slot(plan))
        assert len(made) <= 2
        assert all(str(s.slot_ip) in ("198.19.128.2", "198.19.128.6") for s in made)
    finally:
        for s in made:
            await destroy_slot(s)


async def test_cleanup_stale_removes_leftovers() -> None:
    plan = NetworkPlan()
    slot = await create_slot(plan)
    host_ifindex = host_links()[slot.host_veth]
    # Simulate a crash: the slot is forgotten without teardown. Other servers may share this
    # host, so only this test's slot is named.
    removed = await cleanup_stale(plan, only=[slot.index])
    assert slot.index in removed
    await assert_released(slot, host_ifindex)


async def test_cleanup_stale_keeps_slots_with_live_processes() -> None:
    plan = NetworkPlan()
    slot = await create_slot(plan)
    host_ifindex = host_links()[slot.host_veth]
    # Any process inside the namespace marks it as owned by a live server.
    proc = await asyncio.create_subprocess_exec("ip", "netns", "exec", slot.netns, "sleep", "30")
    try:
        await asyncio.sleep(0.2)
        assert slot.index not in await cleanup_stale(plan, only=[slot.index])
        assert slot.netns in sh("ip", "netns", "list")
    finally:
        proc.kill()
        await proc.wait()
    # Removed here, or by the destroy if the cleanup failed: not both, or the destroy would
    # remove whoever took the freed index in between (another worker's slot, once).
    removed = await cleanup_stale(plan, only=[slot.index])
    if slot.index not in removed:
        await destroy_slot(slot)
    assert slot.index in removed
    await assert_released(slot, host_ifindex)


async def freed_and_taken_again(
    plan: NetworkPlan, owner: Path | None, free: Callable[[Slot], Awaitable[None]]
) -> tuple[Slot, Slot]:
    """A slot made (marked by `owner`) and freed by `free`, then a second one made at its
    index, as another process on the host would take it."""
    for _ in range(5):
        first = await create_slot(plan, owner=owner)
        await free(first)
        try:
            return first, await create_slot(plan, index=first.index)
        except NetworkError:
            continue  # another process on the host took the index first: try again
    pytest.fail("five freed indexes in a row were taken by other processes")


async def test_a_second_teardown_leaves_the_next_holder_of_the_index_alone() -> None:
    """A slot is torn down, another slot takes its index (the lowest free one: at once, when
    other servers share the host), then the first slot object is torn down again. The second
    slot keeps its namespace and host veth. Before slots carried their namespace's cookie, the
    second teardown removed both (the suite saw another worker's guest lose its slot)."""
    plan = NetworkPlan()
    first, second = await freed_and_taken_again(plan, None, destroy_slot)
    try:
        assert second.netns == first.netns
        cookie = await netns_socket.netns_cookie(second.netns)
        host_ifindex = host_links()[second.host_veth]
        await destroy_slot(first)
        assert made_here(second.netns)
        assert host_links().get(second.host_veth) == host_ifindex
        assert await netns_socket.netns_cookie(second.netns) == cookie
    finally:
        await destroy_slot(second)
    await assert_released(second, host_ifindex)


async def test_a_marker_that_outlived_its_slot_removes_nothing_of_the_next_holder(
    tmp_path: Path,
) -> None:
    """A server killed between a slot's teardown and its marker's removal leaves the marker;
    another process takes the index; the next server of the data dir recovers its slots. The
    other process's slot survives: the marker holds the cookie of the namespace it meant.
    Before markers held it, recovery removed the slot by name (another worker's guest lost
    its tap between two QEMUs in three-worker suite runs)."""
    plan = NetworkPlan()

    async def server_dies_in_its_destroy(slot: Slot) -> None:
        async with host_lock():
            await slot_module._teardown(slot)  # the marker stays: the server died here

    first, second = await freed_and_taken_again(plan, tmp_path, server_dies_in_its_destroy)
    try:
        marked = marked_slot(plan, tmp_path, first.index)
        assert marked is not None and marked.cookie == first.cookie != second.cookie
        host_ifindex = host_links()[second.host_veth]
        assert await recover_slots(plan, tmp_path, keep=()) == [first.index]
        assert marked_slot(plan, tmp_path, first.index) is None
        assert made_here(second.netns)
        assert host_links().get(second.host_veth) == host_ifindex
        assert await netns_socket.netns_cookie(second.netns) == second.cookie
    finally:
        await destroy_slot(second)
    await assert_released(second, host_ifindex)


async def test_pool_watermarks() -> None:
    pool = SlotPool(NetworkPlan(), low=1, high=2)
    await pool.start()
    try:
        # Start builds `low`; the rest come back from releases or a refill.
        assert pool.idle == 1
        s1 = await pool.acquire()
        s2 = await pool.acquire()
        s1_ifindex = host_links()[s1.host_veth]
        assert pool.idle == 0 and {s1.index, s2.index} == {s.index for s in pool.busy}
        # Falling below `low` starts a refill up to `high`.
        for _ in range(100):
            if pool.idle == 2:
                break
            await asyncio.sleep(0.02)
        assert pool.idle == 2
        await pool.release(s1)  # pool is full: destroyed
        await assert_released(s1, s1_ifindex)
        pool.high = 3
        # Traffic to the slot address leaves a conntrack entry in its namespace (the guest
        # that would answer is absent, which does not matter to conntrack).
        with contextlib.suppress(OSError, TimeoutError):
            async with asyncio.timeout(0.5):
                await asyncio.open_connection(str(s2.slot_ip), 49983)
        assert await conntrack_entries(s2) >= 1
        # A policy other than the open one leaves a table the reuse must remove.
        await pool.set_egress(s2, Egress.of(internet=False))
        tables = ("ip", "netns", "exec", s2.netns, "nft", "list", "tables")
        assert "agentenv_egress" in sh(*tables)
        await pool.release(s2)  # room in the pool: kept, with its connections forgotten
        assert pool.idle == 3 and s2.netns in sh("ip", "netns", "list")
        assert await conntrack_entries(s2) == 0
        assert "agentenv_egress" not in sh(*tables) and "agentenv_guard" in sh(*tables)

        # After a guest of the open policy a few entries stay (a flush walks the host's
        # whole table); a guest of another policy gets the slot without them.
        pool.high = 8
        s3 = await pool.acquire()
        await knock(s3, 1)
        await pool.release(s3)
        assert await conntrack_entries(s3) >= 1
        others = []  # the pool hands idle slots out in order
        while (again := await pool.acquire()) != s3:
            others.append(again)
        await pool.set_egress(s3, Egress.of(internet=False))
        assert await conntrack_entries(s3) == 0
        for slot in (s3, *others):
            await pool.release(slot)
        # More than a kept slot may carry are forgotten at its release.
        for _ in range(250):  # the refill the loop above started, up to 8
            if pool.idle == 8:
                break
            await asyncio.sleep(0.02)
        pool.high = 9  # room for it
        s4 = await pool.acquire()
        await knock(s4, conntrack.stale_allowed(s4.max_connections) + 1)
        await pool.release(s4)
        assert await conntrack_entries(s4) == 0
    finally:
        await pool.close()
    assert pool.idle == 0


async def test_a_pooled_slot_says_so_in_its_marker(tmp_path: Path) -> None:
    """What a census from outside reads (bench/slots.py): pooled while it waits reset in the
    pool, not while a guest holds it."""
    pool = SlotPool(NetworkPlan(), low=0, high=1, owner=tmp_path)
    try:
        slot = await pool.acquire()
        assert (tmp_path / slot.netns).exists() and not is_pooled(tmp_path, slot.netns)
        await pool.release(slot)
        assert is_pooled(tmp_path, slot.netns)
        assert await pool.acquire() == slot
        assert not is_pooled(tmp_path, slot.netns)
        await pool.release(slot)
    finally:
        await pool.close()
    assert not (tmp_path / slot.netns).exists()


async def knock(slot: Slot, times: int) -> None:
    """Leave `times` tracked connections in the slot's namespace: connection attempts to
    its address from distinct ports (no guest answers, which does not matter to conntrack)."""

    async def one() -> None:
        with contextlib.suppress(OSError, TimeoutError):
            async with asyncio.timeout(0.3):
                await asyncio.open_connection(str(slot.slot_ip), 49983)

    await asyncio.gather(*(one() for _ in range(times)))


def test_pool_rejects_bad_watermarks() -> None:
    with pytest.raises(ValueError, match="watermarks"):
        SlotPool(NetworkPlan(), low=3, high=1)
