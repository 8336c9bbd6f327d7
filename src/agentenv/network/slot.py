"""One network slot: a namespace holding the guest's tap, joined to the host by a veth pair.

Slot `i` owns the /30 at `slot_cidr + 4*i`: `.1` is the host end (`ae-h{i}`), `.2` the
namespace end (`ae-n{i}`) and the address the host uses to reach the guest. Inside, every slot
looks the same (tap0, gateway 169.254.0.1, guest 169.254.0.2, one MAC), so a VM snapshotted in
one slot runs unchanged in any other.

What a guest sends is checked on the tap's ingress (`nft.guard_ruleset`: only its own MAC and
IP, policed to the slot's rate); what it receives is shaped by a tbf qdisc on the tap; its
concurrent connections are capped (`nft.slot_ruleset`). All of it lives on the tap or in the
namespace, so it goes with the slot and is renewed when a slot is reused.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import fcntl
import ipaddress
import logging
import os
import socket
import struct
from collections.abc import AsyncIterator, Collection
from dataclasses import dataclass, field, replace
from pathlib import Path

from pyroute2 import AsyncIPRoute, IPRoute, netns
from pyroute2.netlink import NETLINK_ROUTE
from pyroute2.netlink.exceptions import NetlinkError

from agentenv.aio import thread_whole, whole
from agentenv.config import DEFAULT_SLOT_CIDR, GATEWAY_MAC, NetworkPlan
from agentenv.filelock import file_lock
from agentenv.network import conntrack, netns_socket, nft
from agentenv.network.egress import OPEN, Egress
from agentenv.network.errors import NetworkError, NoFreeSlot
from agentenv.network.netns_socket import add_netns, add_tap, netlink_fd, remove_netns
from agentenv.vmm.confine import vm_ids

log = logging.getLogger(__name__)

NETNS_PREFIX = "ae-s"
HOST_VETH_PREFIX = nft.HOST_PREFIX
NS_VETH_PREFIX = "ae-n"
TAP = "tap0"
# Host-wide: slot creation and the shared host nft table are coordinated across processes.
LOCK_FILE = Path("/run/agentenv-network.lock")
# Holders only build or tear down one slot (tens of ms); a minute means something is stuck.
HOST_LOCK_TIMEOUT_S = 60.0
# Namespaces this process created and has not removed. Other servers on the host reuse the
# same names (and the kernel reuses namespace inode numbers), so this is how tests and
# diagnostics tell this process's slots apart.
# Each name maps to the cookie of the namespace this process made under it.
live_here: dict[str, int] = {}


def _remember(name: str, cookie: int) -> None:
    live_here[name] = cookie


def made_here(name: str) -> bool:
    """Whether the namespace called `name` was created by this process and is still there."""
    return name in live_here and (Path("/run/netns") / name).exists()


@dataclass(frozen=True)
class Slot:
    index: int
    netns: str
    host_veth: str
    ns_veth: str
    tap: str
    host_ip: ipaddress.IPv4Address
    slot_ip: ipaddress.IPv4Address
    guest_ip: ipaddress.IPv4Address
    gateway_ip: ipaddress.IPv4Address
    guest_mac: str
    guest_prefixlen: int
    # Each way, Mbit/s, and concurrent guest connections (`NetworkPlan`); 0 = no limit.
    rate_mbit: int = 0
    max_connections: int = 0
    # The cookie of the namespace this process built the slot in (`netns_socket.netns_cookie`);
    # None for a slot known only by its index (`cleanup_stale`, a marker of an older server).
    # Another process takes the lowest free index as soon as a slot is gone, so a second
    # teardown of a slot object would remove that process's namespace and veth: `_teardown`
    # of a slot with a cookie leaves a namespace with another cookie alone.
    cookie: int | None = field(default=None, compare=False)

    @property
    def netns_path(self) -> Path:
        return Path("/run/netns") / self.netns


def slot_for(plan: NetworkPlan, index: int) -> Slot:
    if not 0 <= index < plan.max_slots:
        raise NoFreeSlot(f"slot {index} is outside {plan.slot_cidr} ({plan.max_slots} slots)")
    base = plan.slot_cidr.network_address + 4 * index
    return Slot(
        index=index,
        netns=f"{NETNS_PREFIX}{index}",
        host_veth=f"{HOST_VETH_PREFIX}{index}",
        ns_veth=f"{NS_VETH_PREFIX}{index}",
        tap=TAP,
        host_ip=base + 1,
        slot_ip=base + 2,
        guest_ip=plan.guest_ip,
        gateway_ip=plan.gateway_ip,
        guest_mac=plan.guest_mac,
        guest_prefixlen=plan.guest_cidr.prefixlen,
        rate_mbit=plan.rate_mbit,
        max_connections=plan.max_connections,
    )


async def adopted_slot(plan: NetworkPlan, index: int) -> Slot:
    """The slot a running VM of an earlier server holds (a restarted server adopting it),
    with the cookie of the namespace the VM runs in, as if this process had built it."""
    slot = slot_for(plan, index)
    return replace(slot, cookie=await netns_socket.netns_cookie(slot.netns))


@contextlib.asynccontextmanager
async def host_lock(waiter: str | None = None) -> AsyncIterator[None]:
    """Slot changes and the host table, one at a time on this host (`filelock`: waiting
    happens in asyncio, so holders' own thread work never queues behind waiters)."""
    async with file_lock(
        LOCK_FILE, name="the host network lock", timeout_s=HOST_LOCK_TIMEOUT_S, waiter=waiter
    ):
        yield


def _existing_indexes() -> set[int]:
    out: set[int] = set()
    for name in netns.listnetns():
        if name.startswith(NETNS_PREFIX) and name[len(NETNS_PREFIX) :].isdigit():
            out.add(int(name[len(NETNS_PREFIX) :]))
    return out


async def _claim_netns(plan: NetworkPlan, start: int) -> Slot:
    """Create the namespace of the lowest free index; O_EXCL on its mount point makes the
    claim atomic against other processes."""
    taken = _existing_indexes()
    for index in range(start, plan.max_slots):
        if index in taken:
            continue
        slot = slot_for(plan, index)
        try:
            cookie = await add_netns(slot.netns)
        except FileExistsError:
            continue
        _remember(slot.netns, cookie)
        return replace(slot, cookie=cookie)
    raise NoFreeSlot(f"no free slot left in {plan.slot_cidr}")


# Every network namespace's loopback device has this index (the kernel's LOOPBACK_IFINDEX).
LOOPBACK_INDEX = 1


async def _link_indexes(slot: Slot, *names: str) -> list[int]:
    """The indexes of links in the slot's namespace, by name: `if_nametoindex` on the
    namespace's thread. A netlink lookup per link decoded a full link message in pyroute2,
    about a quarter of a slot build's CPU."""

    def lookup() -> list[int]:
        return [socket.if_nametoindex(name) for name in names]

    try:
        return await netns_socket.run_in(slot.netns, lookup)
    except OSError as exc:
        raise NetworkError(f"slot {slot.index}: link {names}: {exc.strerror or exc}") from exc


def _marker(slot: Slot, pooled: bool = False) -> bytes:
    """A slot's marker: the cookie of its namespace, then whether it waits in the pool.

    The cookie is what lets the next server of the data dir remove only what the marker
    meant: a server killed between a slot's teardown and its marker's removal leaves the
    marker, and another process may hold the name by then (`_teardown` compares cookies)."""
    cookie = b"" if slot.cookie is None else f"{slot.cookie}\n".encode()
    return cookie + (POOLED if pooled else b"")


def _mark(owner: Path | None, slot: Slot, held: bool) -> None:
    """Marker files name the slots a data dir holds, so its next server can remove the
    ones a crash left (`recover_slots`) without touching other servers' slots."""
    if owner is None:
        return
    marker = owner / slot.netns
    if held:
        owner.mkdir(mode=0o700, parents=True, exist_ok=True)
        marker.write_bytes(_marker(slot))
    else:
        marker.unlink(missing_ok=True)


# What a slot's marker ends with while the slot waits in its server's pool, reset for reuse
# (not while a guest holds it or it is being built).
POOLED = b"pooled\n"


def mark_pooled(owner: Path | None, slot: Slot, pooled: bool) -> None:
    """Say in the slot's marker whether it waits in the pool: a census from outside (the
    benches' leak checks, an operator) tells a pooled slot from one left behind by it (a
    reset no longer always empties the slot's conntrack, which was the only sign)."""
    if owner is None:
        return
    try:
        # Rewritten whole: a crash mid-write leaves a marker without its cookie, which is
        # safe while the slot exists (nobody else can hold a name that is taken).
        (owner / slot.netns).write_bytes(_marker(slot, pooled))
    except OSError as exc:
        # Only what the marker tells from outside is wrong then; the slot itself is fine.
        log.warning("slot %d: marking it %s: %r", slot.index, "pooled" if pooled else "held", exc)


def is_pooled(owner: Path, netns: str) -> bool:
    try:
        return (owner / netns).read_bytes().endswith(POOLED)
    except OSError:
        return False


async def create_slot(
    plan: NetworkPlan, index: int | None = None, *, owner: Path | None = None
) -> Slot:
    """Build a slot (lowest free index unless `index` is given); nothing is left on failure.
    With `owner` (a data dir's slots directory) the slot is marked as held by it."""
    async with host_lock("a new network slot"):
        if index is None:
            slot = await _claim_netns(plan, 0)
        else:
            slot = slot_for(plan, index)
            try:
                cookie = await add_netns(slot.netns)
            except FileExistsError as exc:
                raise NetworkError(f"slot {index} is already in use") from exc
            _remember(slot.netns, cookie)
            slot = replace(slot, cookie=cookie)
        try:
            _mark(owner, slot, True)
            await _build(plan, slot)
            await nft.apply_host_rules()
        except BaseException:
            await _teardown(slot)
            _mark(owner, slot, False)
            raise
    return slot


def _disable_ipv6(ifname: str) -> None:
    # Slots are IPv4 only; a link-local v6 address would be one more path to police.
    v6 = Path(f"/proc/sys/net/ipv6/conf/{ifname}/disable_ipv6")
    if v6.exists():
        v6.write_text("1")


async def _build(plan: NetworkPlan, slot: Slot) -> None:
    try:
        async with AsyncIPRoute() as ipr:
            await ipr.link(
                "add",
                ifname=slot.host_veth,
                kind="veth",
                peer={"ifname": slot.ns_veth, "net_ns_fd": slot.netns},
            )
            idx = socket.if_nametoindex(slot.host_veth)  # an ioctl, in the host's namespace
            _disable_ipv6(slot.host_veth)
            await ipr.addr("add", index=idx, address=str(slot.host_ip), prefixlen=30)
            await ipr.link("set", index=idx, state="up")
        async with AsyncIPRoute(fileno=await netlink_fd(slot.netns, NETLINK_ROUTE)) as ipr:
            await ipr.link("set", index=LOOPBACK_INDEX, state="up")
            # Owned by the uid the slot's confined QEMU runs as: a tap with no owner may be
            # attached by any process that can open /dev/net/tun in this namespace.
            uid, gid = vm_ids(slot.tap, slot.netns)
            await add_tap(slot.netns, slot.tap, uid, gid)
            idx, tap = await _link_indexes(slot, slot.ns_veth, slot.tap)
            await ipr.addr("add", index=idx, address=str(slot.slot_ip), prefixlen=30)
            await ipr.link("set", index=idx, state="up")
            await ipr.addr(
                "add", index=tap, address=str(slot.gateway_ip), prefixlen=slot.guest_prefixlen
            )
            await ipr.link("set", index=tap, address=GATEWAY_MAC, state="up")
            await ipr.route("add", dst="0.0.0.0/0", gateway=str(slot.host_ip))
            await _shape(ipr, slot, tap)
    except NetlinkError as exc:
        raise NetworkError(f"slot {slot.index}: netlink: {exc}") from exc
    rules = nft.slot_ruleset(
        veth=slot.ns_veth,
        tap=slot.tap,
        slot_ip=slot.slot_ip,
        guest_ip=slot.guest_ip,
        gateway_ip=slot.gateway_ip,
        # Its own node's slots, and every other node's: nodes of a cluster take their slot
        # ranges out of the default one, and no guest may reach another node's guests.
        blocked=_slot_space(plan),
        max_connections=slot.max_connections,
    )
    # ip_forward is per namespace; the guest's traffic is routed, not bridged. The guard is
    # in place before any guest can have the tap open.
    await nft.apply(
        slot.netns,
        rules + _guard(slot),
        {"net.ipv4.ip_forward": "1", "net.ipv6.conf.all.disable_ipv6": "1"},
    )


def rate_bytes(slot: Slot) -> int:
    return slot.rate_mbit * 1_000_000 // 8


def _guard(slot: Slot) -> str:
    return nft.guard_ruleset(
        tap=slot.tap, guest_mac=slot.guest_mac, guest_ip=slot.guest_ip, rate_bytes=rate_bytes(slot)
    )


# The tbf toward the guest: its bucket holds 10 ms at the rate (at least 64 KiB, so a GSO
# super-frame from the host passes whole), and packets wait at most this long in its queue
# before they are dropped (TCP then backs off to the rate).
SHAPE_MIN_BURST = 64 * 1024
SHAPE_LATENCY = "50ms"


def shape_parameters(slot: Slot) -> dict[str, object] | None:
    """pyroute2 `tc` arguments of the slot's tbf; None without a rate limit."""
    if slot.rate_mbit <= 0:
        return None
    burst = max(rate_bytes(slot) // 100, SHAPE_MIN_BURST)
    return {"rate": f"{slot.rate_mbit}mbit", "burst": burst, "latency": SHAPE_LATENCY}


async def _shape(ipr: AsyncIPRoute, slot: Slot, tap: int) -> None:
    params = shape_parameters(slot)
    if params is not None:
        await ipr.tc("replace", "tbf", tap, 0, **params)


async def guard_counters(slot: Slot) -> dict[str, int]:
    """Packets the tap's guard dropped so far, by counter (`nft.GUARD_COUNTERS`)."""
    return await nft.counters(slot.netns, "netdev", nft.GUARD_TABLE)


async def conntrack_entries(slot: Slot) -> int:
    """Connections the slot's namespace tracks (dumped: the kernel's counter lags a flush)."""
    return await conntrack.entries(slot.netns)


async def set_egress(slot: Slot, egress: Egress) -> None:
    """Where the guest on `slot` may open connections (`network.egress`); replaces what was
    there, at once, also for a guest that runs (connections it already has stay)."""
    ruleset = nft.egress_ruleset(tap=slot.tap, gateway_ip=slot.gateway_ip, egress=egress)
    await nft.apply(slot.netns, ruleset)


async def apply_guard(slot: Slot) -> None:
    """(Re)build the tap's guard and shaper with the slot's limits, in place: the guard's
    table is replaced in one transaction, so a running guest is never unguarded."""
    await nft.apply(slot.netns, _guard(slot))
    try:
        async with AsyncIPRoute(fileno=await netlink_fd(slot.netns, NETLINK_ROUTE)) as ipr:
            await _shape(ipr, slot, (await _link_indexes(slot, slot.tap))[0])
    except NetlinkError as exc:
        raise NetworkError(f"slot {slot.index}: netlink: {exc}") from exc


async def reset_slot(slot: Slot, *, egress_open: bool = False) -> bool:
    """Ready a slot for its next guest; returns whether it kept connections its last guest
    left tracked (`forget_connections` then drops them before a guest of another policy
    runs there). The guard's counters start from zero.

    A guest under any policy but the open one had its connections judged by rules the next
    guest may not have: they are forgotten, or a stale entry would let the next guest's
    packets through as replies. After a guest of the open policy throughout
    (`egress_open`) they are kept while few (`conntrack.stale_allowed`): an open guest
    could open each of them itself, from the same address through the same NAT, and a
    flush walks the host's whole table (~1.3 ms of CPU a kill). What the host's own
    connections to the guest left (the proxy's, ended) is most of it.

    Nothing is rebuilt: replacing the guard's table (or deleting an egress table) unhooks a
    chain from the tap, and the kernel waits for an RCU grace period on every such commit
    (~15 ms each here); the rules, the tbf and the addresses are what the slot was built
    with, and nothing the guest does changes them. What the last guest's traffic left in the
    guard's rate limit and in the tbf's bucket refills at the rate. `egress_open`: the slot's
    policy is known to be the open one (no egress table), so there is none to remove."""
    if not egress_open:
        await set_egress(slot, OPEN)
    keep_up_to = conntrack.stale_allowed(slot.max_connections) if egress_open else -1

    def reset_in_namespace() -> bool:
        if _tap_held(slot.tap):
            # A QEMU that would not die (the kernel holds it) still has the tap: the next
            # guest could not open it. The pool destroys the slot instead.
            raise NetworkError(f"slot {slot.index}: its tap is still held by a process")
        nft.nft_run(f"reset counters table netdev {nft.GUARD_TABLE}\n")
        tracked = conntrack.tracked_here()
        if tracked is not None and tracked <= keep_up_to:
            return tracked > 0
        conntrack.flush_here()
        return False

    # One hop into the namespace for all of it (each was a thread hop of its own, and
    # pyroute2's flush ~0.6 ms of the server's CPU per kill; the raw message ~0.1).
    try:
        async with asyncio.timeout(nft.COMMAND_TIMEOUT_S):
            return await netns_socket.run_in(slot.netns, reset_in_namespace)
    except TimeoutError:
        raise NetworkError(f"slot {slot.index}: resetting its guard did not finish") from None
    except OSError as exc:
        raise NetworkError(f"slot {slot.index}: {exc}") from exc


async def forget_connections(slot: Slot) -> None:
    """Forget every connection the slot's namespace tracks."""
    try:
        async with asyncio.timeout(nft.COMMAND_TIMEOUT_S):
            await netns_socket.run_in(slot.netns, conntrack.flush_here)
    except TimeoutError:
        raise NetworkError(f"slot {slot.index}: the conntrack flush did not finish") from None
    except OSError as exc:
        raise NetworkError(f"slot {slot.index}: {exc}") from exc


def _tap_held(tap: str) -> bool:
    """In the slot's namespace: whether a process has `tap` open. A tap has carrier only
    while one does; ethtool's link state reads the carrier as it is now (the link's
    IFF_RUNNING follows it only after the kernel's link watch, up to a second later)."""
    value = ctypes.create_string_buffer(struct.pack("II", _ETHTOOL_GLINK, 0), 8)
    req = struct.pack("16sP", tap.encode(), ctypes.addressof(value)).ljust(40, b"\0")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        fcntl.ioctl(sock, _SIOCETHTOOL, req)
    linked: int = struct.unpack("II", value.raw)[1]
    return linked != 0


_SIOCETHTOOL = 0x8946
_ETHTOOL_GLINK = 0x0000000A


def _delete_host_veth(name: str) -> None:
    """Delete the host end of a slot's pair (its peer goes with it); gone already is fine.

    Blocking, so it runs in a thread: the kernel unregisters a veth inside the netlink
    request itself, waiting out RCU grace periods under the rtnl lock (18-50 ms each on the
    dev machine). On the event loop that held every request of the server: a kill of 20
    sandboxes whose slots the pool did not keep stalled it ~40 ms per slot."""
    try:
        index = socket.if_nametoindex(name)
    except OSError:
        return
    with IPRoute() as ipr:
        ipr.link("del", index=index)


async def _teardown(slot: Slot) -> None:
    if slot.cookie is not None and await netns_socket.netns_cookie(slot.netns) != slot.cookie:
        # Gone already, and the name and the veth's may be another slot's by now. This
        # process forgets the name unless the slot under it now is one it made itself.
        if live_here.get(slot.netns) == slot.cookie:
            del live_here[slot.netns]
        log.warning("slot %d: already removed; its name is left to whoever holds it", slot.index)
        return
    # Deleting the host end removes its peer; the namespace takes the tap with it.
    try:
        await thread_whole(_delete_host_veth, slot.host_veth)
    except NetlinkError:
        pass
    except Exception as exc:
        # The namespace still goes, and its end of the pair takes ours with it (once the
        # kernel's namespace cleanup has run, shortly after): a failure here once left a
        # namespace nobody removed until the next start.
        log.warning("slot %d: deleting %s: %r", slot.index, slot.host_veth, exc)
    if slot.netns_path.exists():
        await whole(remove_netns(slot.netns))
    live_here.pop(slot.netns, None)
    if not [v for v in _host_veths() if v != slot.host_veth]:  # ours goes with the namespace
        await nft.remove_host_rules()


def _host_veths() -> list[str]:
    return [
        n
        for n in os.listdir("/sys/class/net")
        if n.startswith(HOST_VETH_PREFIX) and n[len(HOST_VETH_PREFIX) :].isdigit()
    ]


def _slot_space(plan: NetworkPlan) -> list[ipaddress.IPv4Network]:
    """Every slot address a guest must not reach: its own node's range and the default one
    (nft refuses overlapping intervals in one set, so a range inside the default is not
    listed again)."""
    default = ipaddress.IPv4Network(DEFAULT_SLOT_CIDR)
    own = plan.slot_cidr
    if own.subnet_of(default) or default.subnet_of(own):
        return [own if default.subnet_of(own) else default]
    return [default, own]


async def destroy_slot(slot: Slot, *, owner: Path | None = None) -> None:
    async with host_lock(f"removing slot {slot.index}"):
        await _teardown(slot)
    _mark(owner, slot, False)


def marked_slot(plan: NetworkPlan, owner: Path, index: int) -> Slot | None:
    """The slot `owner`'s marker names at `index`, with the cookie it recorded; None without
    a marker (its server removed the slot, or never had it)."""
    try:
        text = (owner / f"{NETNS_PREFIX}{index}").read_bytes()
    except FileNotFoundError:
        return None
    first = text.split(b"\n", 1)[0]
    # No cookie: a marker of an older server, or one cut short while its slot existed.
    return replace(slot_for(plan, index), cookie=int(first) if first.isdigit() else None)


def marked_slots(plan: NetworkPlan, owner: Path) -> list[Slot]:
    """The slots `owner` holds by its markers."""
    if not owner.is_dir():
        return []
    out = []
    for marker in sorted(owner.iterdir()):
        index = marker.name[len(NETNS_PREFIX) :]
        if marker.name.startswith(NETNS_PREFIX) and index.isdigit():
            if int(index) < plan.max_slots:
                slot = marked_slot(plan, owner, int(index))
                if slot is not None:
                    out.append(slot)
            else:
                marker.unlink(missing_ok=True)
    return out


async def recover_slots(plan: NetworkPlan, owner: Path, keep: Collection[int]) -> list[int]:
    """Remove every slot `owner` holds except `keep` (those of VMs a restarted server
    adopted): what a crashed server of this data dir left (its pool, dead VMs' slots)."""
    removed = []
    for slot in marked_slots(plan, owner):
        if slot.index not in keep:
            await destroy_slot(slot, owner=owner)
            removed.append(slot.index)
    return removed


def _netns_in_use(name: str) -> bool:
    """Whether any process runs inside the named namespace (a live VM of some server)."""
    try:
        target = os.stat(Path("/run/netns") / name).st_ino
    except FileNotFoundError:
        return False
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                if os.stat(f"/proc/{entry}/ns/net").st_ino == target:
                    return True
    return False


async def cleanup_stale(
    plan: NetworkPlan, *, only: Collection[int] | None = None, force: bool = False
) -> list[int]:
    """Remove slots left by a crashed server (namespaces `ae-s*`, links `ae-h*`, the host
    table), or just the indexes in `only` (those the server's own records name). A slot whose
    namespace still has a process in it belongs to a live VM and is kept unless `force`."""
    indexes = _existing_indexes()
    for name in _host_veths():
        indexes.add(int(name[len(HOST_VETH_PREFIX) :]))
    if only is not None:
        indexes &= set(only)
    removed: list[int] = []
    async with host_lock("stale slot cleanup"):
        for i in sorted(indexes):
            if i >= plan.max_slots:
                continue
            slot = slot_for(plan, i)
            if not force and await asyncio.to_thread(_netns_in_use, slot.netns):
                continue
            await _teardown(slot)
            removed.append(i)
        if not _host_veths():
            await nft.remove_host_rules()
    return removed
