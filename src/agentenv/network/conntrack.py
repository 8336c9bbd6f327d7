"""The connections a slot's namespace tracks: how many, forgetting them all, and how many a
kept slot may carry over to its next guest (`network.slot.reset_slot`).

The kernel keeps every namespace's tracked connections in one host-wide hash table, so a
flush walks all of its buckets whatever the namespace holds: 262144 buckets here, ~1.3 ms of
the server's CPU in the kernel, the largest part of a kill's. The count, by contrast, is a
per-namespace counter read from `/proc`.
"""

from __future__ import annotations

import errno
import os
import socket
import struct
from pathlib import Path

from pyroute2 import AsyncConntrack
from pyroute2.netlink import NETLINK_NETFILTER

from agentenv.network import nft
from agentenv.network.netns_socket import netlink_fd

# A kept slot whose last guest had the open policy throughout may keep what it left tracked
# while that is at most this many entries and at most 1/STALE_CAP_SHARE of the slot's
# connection cap (stale entries of the guest's own count against the cap until they end).
STALE_KEPT_MAX = 64
STALE_CAP_SHARE = 64

# Resolved in the namespace of the thread that opens it (as all of /proc/sys/net).
_COUNT = Path("/proc/sys/net/netfilter/nf_conntrack_count")

# <linux/netlink.h>, <linux/netfilter/nfnetlink.h>, <linux/netfilter/nfnetlink_conntrack.h>
_NLM_F_REQUEST = 0x1
_NLM_F_ACK = 0x4
_NLMSG_ERROR = 0x2
_CT_DELETE = (1 << 8) | 2  # NFNL_SUBSYS_CTNETLINK, IPCTNL_MSG_CT_DELETE
_NLMSG_HEADER = struct.Struct("=IHHII")  # length, type, flags, sequence, port id
_NFGENMSG = struct.Struct("=BBH")  # family, version (NFNETLINK_V0), resource id


def stale_allowed(max_connections: int) -> int:
    """How many tracked entries a kept slot with this connection cap (0: none) may keep."""
    if max_connections <= 0:
        return STALE_KEPT_MAX
    return min(STALE_KEPT_MAX, max_connections // STALE_CAP_SHARE)


def tracked_here() -> int | None:
    """In the calling thread's namespace: how many connections it tracks (the kernel's
    counter, which lags a flush a little); None when conntrack is not loaded."""
    try:
        return int(_COUNT.read_bytes())
    except (OSError, ValueError):
        return None


def flush_here() -> None:
    """In the calling thread's namespace: forget every IPv4 connection it tracks. A
    CT_DELETE with no attributes is the flush (what `conntrack -F` and pyroute2's `flush`
    send); the kernel's ack carries its errno."""
    request = _NLMSG_HEADER.pack(
        _NLMSG_HEADER.size + _NFGENMSG.size, _CT_DELETE, _NLM_F_REQUEST | _NLM_F_ACK, 1, 0
    ) + _NFGENMSG.pack(socket.AF_INET, 0, 0)
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER) as sock:
        sock.settimeout(nft.COMMAND_TIMEOUT_S)
        sock.send(request)
        reply = sock.recv(4096)
    if len(reply) < _NLMSG_HEADER.size + 4:
        raise OSError(errno.EPROTO, f"conntrack flush: a short answer ({len(reply)} bytes)")
    kind = _NLMSG_HEADER.unpack_from(reply)[1]
    code = struct.unpack_from("=i", reply, _NLMSG_HEADER.size)[0]
    if kind == _NLMSG_ERROR and code != 0:
        raise OSError(-code, f"conntrack flush: {os.strerror(-code)}")


async def entries(netns: str) -> int:
    """Connections the named namespace tracks, dumped (the counter lags a flush)."""
    async with AsyncConntrack(fileno=await netlink_fd(netns, NETLINK_NETFILTER)) as ct:
        return len([e async for e in await ct.dump_entries()])
