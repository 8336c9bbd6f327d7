"""nftables rule sets for a slot's namespace and for the host.

Rule sets are written in nft's rule language (stable and readable). A slot's are applied
in-process through libnftables (libnftables.so.1, the library behind the `nft` CLI, bound
with ctypes) from the namespace thread of `network.netns_socket`; the host-wide table from a
worker thread, which stays in the host's namespace. One buffer is one transaction, and no path
spawns nsenter, sh or nft.
"""

from __future__ import annotations

import asyncio
import ctypes
import ipaddress
import json
import threading
from pathlib import Path

from agentenv.network import netns_socket
from agentenv.network.egress import Egress
from agentenv.network.errors import NetworkError

TABLE = "agentenv"
HOST_PREFIX = "ae-h"
IP_FORWARD = Path("/proc/sys/net/ipv4/ip_forward")
# Present while agentenv is the reason the host forwards IPv4: the host then routes nothing
# but slot traffic, and forwarding goes back off with the last slot.
FORWARD_MARK = Path("/run/agentenv-ip-forward")
# nft and a namespace's sysctl writes take milliseconds; this long means a stuck host.
COMMAND_TIMEOUT_S = 30.0


_NFT_CTX_OUTPUT_JSON = 1 << 4
# A transaction the kernel refused with EINTR was aborted whole (nf_tables applies a batch
# all or nothing), so it is run again, at most this many times in all. Seen once in the
# suite on a slot's reset, with nothing else wrong.
_EINTR_ATTEMPTS = 3
_EINTR = "Interrupted system call"
_lib: ctypes.CDLL | None = None
_lib_lock = threading.Lock()


def _libnftables() -> ctypes.CDLL:
    global _lib
    with _lib_lock:
        if _lib is None:
            try:
                lib = ctypes.CDLL("libnftables.so.1", use_errno=True)
            except OSError as exc:
                raise NetworkError(
                    "libnftables.so.1 is missing (apt-get install libnftables1)"
                ) from exc
            lib.nft_ctx_new.restype = ctypes.c_void_p
            lib.nft_ctx_new.argtypes = [ctypes.c_uint32]
            lib.nft_ctx_free.argtypes = [ctypes.c_void_p]
            lib.nft_ctx_buffer_output.argtypes = [ctypes.c_void_p]
            lib.nft_ctx_buffer_error.argtypes = [ctypes.c_void_p]
            lib.nft_ctx_get_output_buffer.restype = ctypes.c_char_p
            lib.nft_ctx_get_output_buffer.argtypes = [ctypes.c_void_p]
            lib.nft_ctx_get_error_buffer.restype = ctypes.c_char_p
            lib.nft_ctx_get_error_buffer.argtypes = [ctypes.c_void_p]
            lib.nft_ctx_output_set_flags.argtypes = [ctypes.c_void_p, ctypes.c_uint]
            lib.nft_run_cmd_from_buffer.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
            _lib = lib
        return _lib


def nft_run(text: str, *, json_output: bool = False) -> str:
    """Run nft commands (what `nft -f -` reads) in this thread's network namespace; one call
    is one transaction. Returns nft's output; raises NetworkError with its last error line."""
    for attempt in range(1, _EINTR_ATTEMPTS + 1):
        try:
            return _run_once(text, json_output)
        except NetworkError as exc:
            if _EINTR not in str(exc) or attempt == _EINTR_ATTEMPTS:
                raise
    raise AssertionError("unreachable")


def _run_once(text: str, json_output: bool) -> str:
    lib = _libnftables()
    ctx = lib.nft_ctx_new(0)  # NFT_CTX_DEFAULT
    if not ctx:
        raise NetworkError("libnftables: cannot create a context")
    try:
        lib.nft_ctx_buffer_output(ctx)
        lib.nft_ctx_buffer_error(ctx)
        if json_output:
            lib.nft_ctx_output_set_flags(ctx, _NFT_CTX_OUTPUT_JSON)
        rc = lib.nft_run_cmd_from_buffer(ctx, text.encode())
        out = (lib.nft_ctx_get_output_buffer(ctx) or b"").decode(errors="replace")
        if rc != 0:
            err = (lib.nft_ctx_get_error_buffer(ctx) or b"").decode(errors="replace")
            lines = [line for line in err.strip().splitlines() if line.strip()]
            raise NetworkError(f"nft: {lines[0] if lines else 'command failed'}")
        return out
    finally:
        lib.nft_ctx_free(ctx)


def _write_sysctls(sysctls: dict[str, str]) -> None:
    # /proc/sys/net resolves to the namespace of the thread that opens it.
    for key, value in sysctls.items():
        Path("/proc/sys", *key.split(".")).write_text(value)


async def apply(netns: str, ruleset: str, sysctls: dict[str, str] | None = None) -> None:
    """Write `sysctls` (dotted names) and apply `ruleset` inside `netns`, in-process."""

    def work() -> None:
        _write_sysctls(sysctls or {})
        nft_run(ruleset)

    try:
        async with asyncio.timeout(COMMAND_TIMEOUT_S):
            await netns_socket.run_in(netns, work)
    except TimeoutError:
        raise NetworkError(
            f"netns {netns}: nft did not finish in {COMMAND_TIMEOUT_S:.0f}s"
        ) from None
    except OSError as exc:
        raise NetworkError(f"netns {netns}: {exc}") from exc


async def counters(netns: str, family: str, table: str) -> dict[str, int]:
    """Packets each named counter of a table in `netns` has counted."""
    try:
        async with asyncio.timeout(COMMAND_TIMEOUT_S):
            out = await netns_socket.run_in(
                netns,
                lambda: nft_run(f"list counters table {family} {table}", json_output=True),
            )
    except TimeoutError:
        raise NetworkError(f"netns {netns}: nft list counters did not finish") from None
    except OSError as exc:
        raise NetworkError(f"netns {netns}: {exc}") from exc
    found: dict[str, int] = {}
    for item in json.loads(out)["nftables"]:
        counter = item.get("counter")
        if counter is not None:
            found[str(counter["name"])] = int(counter["packets"])
    return found


# What a guest may never reach through its slot, whatever its policy says: link-local space
# (cloud metadata services live at 169.254.169.254), multicast and reserved space.
ALWAYS_BLOCKED = (
    ipaddress.IPv4Network("169.254.0.0/16"),
    ipaddress.IPv4Network("224.0.0.0/3"),
    ipaddress.IPv4Network("0.0.0.0/8"),
)
# The slot gateway serves DNS (`network.dns`) and, for policies that name domains, the
# proxy that ports 80/443 are redirected to (`network.inspect`).
DNS_PORT = 53
INSPECT_PORT = 15080


def slot_ruleset(
    *,
    veth: str,
    tap: str,
    slot_ip: ipaddress.IPv4Address,
    guest_ip: ipaddress.IPv4Address,
    gateway_ip: ipaddress.IPv4Address,
    blocked: list[ipaddress.IPv4Network],
    max_connections: int = 0,
) -> str:
    """Rules inside one slot's namespace.

    The host reaches every guest port at the slot address (DNAT). The guest's own new
    connections may leave through the veth (masqueraded to the slot address), but never to
    another slot, the host-side range, link-local space or the namespace itself; of the
    namespace it reaches only the gateway's DNS port and, when redirected there, the
    inspecting proxy.

    With `max_connections`, a guest that already has that many connections tracked (out
    through the slot or to its gateway, together) has further ones refused at once. One
    `ct count` rule, reached from both hooks, keeps one count; closed TCP connections
    (TIME_WAIT) drop out of it, so a guest that closed its sockets can open new ones.
    """
    block = ", ".join(str(n) for n in (*blocked, *ALWAYS_BLOCKED))
    if max_connections > 0:
        cap = f'    iifname "{tap}" ct state new jump {GUEST_NEW}'
        cap_chains = f"""  counter {OVER_CAP} {{
  }}
  chain {GUEST_NEW} {{
    ct count over {max_connections} goto {REFUSE}
  }}
  chain {REFUSE} {{
    counter name "{OVER_CAP}"
    meta l4proto tcp reject with tcp reset
    reject with icmpx type admin-prohibited
  }}
"""
    else:
        cap = cap_chains = ""
    return f"""
table inet {TABLE}
delete table inet {TABLE}
table inet {TABLE} {{
{cap_chains}  chain prerouting {{
    type nat hook prerouting priority dstnat; policy accept;
    iifname "{veth}" ip daddr {slot_ip} dnat ip to {guest_ip}
  }}
  chain postrouting {{
    type nat hook postrouting priority srcnat; policy accept;
    iifname "{tap}" oifname "{veth}" masquerade
  }}
  chain forward {{
    type filter hook forward priority filter; policy drop;
    ct state established,related accept
    ct state invalid drop
{cap}
    iifname "{veth}" oifname "{tap}" ip daddr {guest_ip} accept
    iifname "{tap}" ip daddr {{ {block} }} meta l4proto tcp reject with tcp reset
    iifname "{tap}" ip daddr {{ {block} }} reject with icmpx type admin-prohibited
    iifname "{tap}" oifname "{veth}" meta nfproto ipv4 accept
  }}
  chain input {{
    type filter hook input priority filter; policy accept;
{cap}
    iifname "{tap}" ip daddr {gateway_ip} meta l4proto {{ tcp, udp }} th dport {DNS_PORT} accept
    iifname "{tap}" ip daddr {gateway_ip} tcp dport {INSPECT_PORT} ct status dnat accept
    iifname "{tap}" ct state new drop
  }}
}}
"""


# The connection cap's chains and the counter of connections it refused.
GUEST_NEW = "guest_new"
REFUSE = "refuse"
OVER_CAP = "over_cap"

# Frames from the guest are checked on the tap's ingress, before routing or conntrack see
# them (`guard_ruleset`).
GUARD_TABLE = "agentenv_guard"
# Drop counters, one per kind of forgery, and the policer's.
GUARD_COUNTERS = ("spoof_mac", "spoof_arp", "spoof_ip", "other_proto", "over_rate")


def guard_ruleset(
    *,
    tap: str,
    guest_mac: str,
    guest_ip: ipaddress.IPv4Address,
    rate_bytes: int = 0,
) -> str:
    """The tap's ingress guard (a `netdev` table in the slot's namespace): a guest may only
    send as itself. Every slot gives its guest the same MAC and IP, so the guard is the same
    on every slot and a snapshot restored into any slot passes it.

    Dropped, each kind counted: a frame whose Ethernet source is not the guest's MAC; an
    ARP packet that is not Ethernet/IPv4 or whose sender is not the guest's MAC and IP (no
    poisoning of the gateway's neighbour table); an IPv4 packet from any other source; any
    other ethertype (slots are IPv4 only, so also IPv6 and VLAN tags). With `rate_bytes`,
    what the guest sends beyond that many bytes per second is dropped (a policer: the tap's
    qdisc only shapes what goes to the guest). Its bucket holds one second of the rate."""
    arp = "ether type arp"
    police = (
        f'    limit rate over {rate_bytes} bytes/second counter name "over_rate" drop\n'
        if rate_bytes > 0
        else ""
    )
    counters = "".join(f"  counter {name} {{\n  }}\n" for name in GUARD_COUNTERS)
    return f"""
table netdev {GUARD_TABLE}
delete table netdev {GUARD_TABLE}
table netdev {GUARD_TABLE} {{
{counters}  chain ingress {{
    type filter hook ingress device "{tap}" priority -500; policy drop;
    ether saddr != {guest_mac} counter name "spoof_mac" drop
    {arp} arp htype != 1 counter name "spoof_arp" drop
    {arp} arp ptype != ip counter name "spoof_arp" drop
    {arp} arp hlen != 6 counter name "spoof_arp" drop
    {arp} arp plen != 4 counter name "spoof_arp" drop
    {arp} arp saddr ether != {guest_mac} counter name "spoof_arp" drop
    {arp} arp saddr ip != {guest_ip} counter name "spoof_arp" drop
    ether type ip ip saddr != {guest_ip} counter name "spoof_ip" drop
    ether type != {{ ip, arp }} counter name "other_proto" drop
{police}    accept
  }}
}}
"""


EGRESS_TABLE = "agentenv_egress"


LEARNED_SET = "learned"


def egress_ruleset(*, tap: str, gateway_ip: ipaddress.IPv4Address, egress: Egress) -> str:
    """A slot's egress policy (`network.egress`), in a table of its own next to the slot's
    rules, so it can be replaced alone and at once. New connections the guest opens to an
    allowed destination pass this table (the slot's own rules still apply after it); to a
    denied one they are refused at once (TCP reset, ICMP admin-prohibited otherwise), not
    dropped into a silent hang. Replies to connections into the guest (the proxy) are
    established and pass. One rule per entry: prefixes may overlap.

    A policy that names domains sends TCP 80/443 to the inspecting proxy on the gateway, which
    decides by Host/SNI, and allows the addresses its DNS forwarder returned for an allowed
    name (the `learned` set, each element timing out with its answer)."""
    reset = f"table inet {EGRESS_TABLE}\ndelete table inet {EGRESS_TABLE}\n"
    if egress.open:
        return reset
    new = f'iifname "{tap}" ct state new'
    rules = []
    parts = []
    if egress.allow_domains:
        parts.append(f"  set {LEARNED_SET} {{\n    type ipv4_addr; flags timeout;\n  }}\n")
        rules.append(f"    {new} ip daddr @{LEARNED_SET} accept")
    if egress.inspects:
        parts.append(
            "  chain prerouting {\n"
            "    type nat hook prerouting priority dstnat - 10; policy accept;\n"
            f'    iifname "{tap}" ip daddr != {gateway_ip} tcp dport {{ 80, 443 }} '
            f"redirect to :{INSPECT_PORT}\n"
            "  }\n"
        )
    rules += [f"    {new} ip daddr {net} accept" for net in egress.allowed]
    for net in egress.denied:
        rules.append(f"    {new} ip daddr {net} meta l4proto tcp reject with tcp reset")
        rules.append(f"    {new} ip daddr {net} reject with icmpx type admin-prohibited")
    body = "\n".join(rules)
    chain = "    type filter hook forward priority filter - 10; policy accept;"
    parts.append(f"  chain forward {{\n{chain}\n{body}\n  }}\n")
    return reset + f"table inet {EGRESS_TABLE} {{\n{''.join(parts)}}}\n"


def learn_command(addresses: dict[ipaddress.IPv4Address, int]) -> str:
    """Allow `addresses` (each for its number of seconds) in a slot's `learned` set, in one
    transaction. `add` leaves an existing element's timeout alone, so each is added, deleted
    and added again with its new timeout."""
    where = f"inet {EGRESS_TABLE} {LEARNED_SET}"
    timed = ", ".join(f"{ip} timeout {max(1, ttl)}s" for ip, ttl in addresses.items())
    bare = ", ".join(str(ip) for ip in addresses)
    return (
        f"add element {where} {{ {bare} }}\n"
        f"delete element {where} {{ {bare} }}\n"
        f"add element {where} {{ {timed} }}\n"
    )


def host_ruleset(*, slots_only: bool = False) -> str:
    """Host-side rules shared by all slots: slots may not open connections to the host itself
    or to each other (refused at once, not dropped into a hang); replies to the host's own
    connections pass; nothing routed through the host may open a connection into a slot (the
    proxy is the way in). Guest traffic leaving the host is masqueraded to the outgoing
    interface's address. With `slots_only` (forwarding was off before agentenv turned it on)
    the host forwards nothing that is not slot traffic."""
    others = (
        f'    iifname != "{HOST_PREFIX}*" oifname != "{HOST_PREFIX}*" drop\n' if slots_only else ""
    )
    return f"""
table inet {TABLE}
delete table inet {TABLE}
table inet {TABLE} {{
  chain input {{
    type filter hook input priority filter; policy accept;
    iifname "{HOST_PREFIX}*" ct state established,related accept
    iifname "{HOST_PREFIX}*" meta l4proto tcp reject with tcp reset
    iifname "{HOST_PREFIX}*" reject with icmpx type admin-prohibited
  }}
  chain forward {{
    type filter hook forward priority filter; policy accept;
    iifname "{HOST_PREFIX}*" oifname "{HOST_PREFIX}*" meta l4proto tcp reject with tcp reset
    iifname "{HOST_PREFIX}*" oifname "{HOST_PREFIX}*" reject with icmpx type admin-prohibited
    oifname "{HOST_PREFIX}*" ct state established,related accept
    oifname "{HOST_PREFIX}*" drop
{others}  }}
  chain postrouting {{
    type nat hook postrouting priority srcnat; policy accept;
    iifname "{HOST_PREFIX}*" oifname != "{HOST_PREFIX}*" masquerade
  }}
}}
"""


def _enable_forwarding() -> bool:
    """Turn on host IPv4 forwarding (guests reach beyond the host only through it); returns
    whether agentenv owns that setting, i.e. it was off before the first slot."""
    if FORWARD_MARK.exists():
        return True
    if IP_FORWARD.read_text().strip() == "1":
        return False
    FORWARD_MARK.touch()
    IP_FORWARD.write_text("1")
    return True


# What each host ruleset this process applied lists as, handles left out. A slot's build
# replaces the host table only when it is missing or lists otherwise (another version's
# rules, a change by hand): replacing it unhooks its chains, and the kernel waits out an RCU
# grace period for that (9-17 ms here), in builds the host lock serializes host-wide.
_host_listed: dict[str, str] = {}


def _host_listing() -> str | None:
    """The host table as nft lists it (JSON, without handles), or None if it is not there."""
    try:
        out = nft_run(f"list table inet {TABLE}", json_output=True)
    except NetworkError:
        return None
    items = []
    for item in json.loads(out)["nftables"]:
        for kind, body in item.items():
            if kind != "metainfo":
                items.append({"kind": kind, **{k: v for k, v in body.items() if k != "handle"}})
    return json.dumps(items, sort_keys=True)


def _ensure_host_table() -> None:
    ruleset = host_ruleset(slots_only=_enable_forwarding())
    known = _host_listed.get(ruleset)
    if known is not None and _host_listing() == known:
        return
    nft_run(ruleset)
    listing = _host_listing()
    if listing is not None:
        _host_listed[ruleset] = listing


async def apply_host_rules() -> None:
    """The host-wide table (`host_ruleset`), in-process in the host's namespace: made or
    replaced (one transaction) as a slot is built, unless it lists as this process applied
    it. Callers hold the host lock (`slot.host_lock`)."""
    try:
        async with asyncio.timeout(COMMAND_TIMEOUT_S):
            await asyncio.to_thread(_ensure_host_table)
    except TimeoutError:
        raise NetworkError(f"host: nft did not finish in {COMMAND_TIMEOUT_S:.0f}s") from None


async def host_table_exists() -> bool:
    try:
        await _host_nft(f"list table inet {TABLE}")
    except NetworkError:
        return False
    return True


async def remove_host_rules() -> None:
    if await host_table_exists():
        await _host_nft(f"delete table inet {TABLE}")
    await asyncio.to_thread(_restore_forwarding)


async def _host_nft(commands: str) -> None:
    # A worker thread of the default executor is in the host's namespace (only
    # `netns_socket`'s own thread ever enters a slot's).
    try:
        async with asyncio.timeout(COMMAND_TIMEOUT_S):
            await asyncio.to_thread(nft_run, commands)
    except TimeoutError:
        raise NetworkError(f"host: nft did not finish in {COMMAND_TIMEOUT_S:.0f}s") from None


def _restore_forwarding() -> None:
    """Leave the host as agentenv found it."""
    if FORWARD_MARK.exists():
        IP_FORWARD.write_text("0")
        FORWARD_MARK.unlink()
