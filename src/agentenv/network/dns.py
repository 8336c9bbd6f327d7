"""The resolver every guest is given: port 53 on its slot's gateway, answered by this node.

Guests' `/etc/resolv.conf` names the gateway (the same address in every slot, so snapshots
run anywhere). The node forwards each query to its upstream resolvers (`AGENTENV_DNS`, else
the host's own) from the host, and on the way applies the sandbox's egress policy: a name it
denies does not exist (NXDOMAIN), no name resolves when nothing may be reached (REFUSED), and
the addresses of an allowed name become reachable for as long as the answer lives (the
slot's `learned` set) — that is how a domain entry holds on ports the inspecting proxy does
not see.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import socket
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any

import dns.asyncquery
import dns.exception
import dns.flags
import dns.message
import dns.opcode
import dns.rcode
import dns.rdatatype

from agentenv.network.egress import DnsVerdict, Egress
from agentenv.network.errors import NetworkError
from agentenv.network.netns_socket import socket_in
from agentenv.network.nft import DNS_PORT

log = logging.getLogger(__name__)

Upstream = tuple[str, int]
Learn = Callable[[dict[ipaddress.IPv4Address, int]], Awaitable[None]]

# One upstream gets this long per query before the next is asked; a guest's resolver
# retries on its own (glibc: 5 s, twice), so the whole answer stays within its patience.
UPSTREAM_TIMEOUT_S = 2.0
MAX_UPSTREAMS = 3
# Work one guest can put on the node at once: more queries in flight are dropped (UDP; the
# guest retries) or connections refused (TCP).
MAX_INFLIGHT = 64
MAX_TCP_CONNECTIONS = 16
TCP_IDLE_S = 10.0
# A learned address outlives its answer a little: the guest's own cache may hand it out
# until the TTL ends, and the connect follows.
MIN_LEARNED_S = 60
LEARN_GRACE_S = 30
MAX_LEARNED_S = 24 * 3600


def parse_upstream(entry: str) -> Upstream:
    """`ip` or `ip:port` (IPv4)."""
    host, _, port = entry.strip().partition(":")
    try:
        ipaddress.IPv4Address(host)
        number = int(port) if port else DNS_PORT
    except ValueError:
        raise NetworkError(f"DNS upstream {entry!r} is not IPv4[:port]") from None
    if not 0 < number < 65536:
        raise NetworkError(f"DNS upstream {entry!r}: port out of range")
    return host, number


class DnsForwarder:
    """Asks the node's upstream resolvers; one per node, shared by every slot."""

    def __init__(self, upstreams: Sequence[str], timeout_s: float = UPSTREAM_TIMEOUT_S) -> None:
        self.upstreams = [parse_upstream(u) for u in upstreams][:MAX_UPSTREAMS]
        self.timeout_s = timeout_s

    async def resolve(self, query: dns.message.Message, *, tcp: bool) -> dns.message.Message:
        """The first upstream's answer; SERVFAIL when none answers in time."""
        for host, port in self.upstreams:
            try:
                if tcp:
                    return await dns.asyncquery.tcp(query, host, self.timeout_s, port)
                # A truncated answer goes back as it is: the guest asks again over TCP.
                return await dns.asyncquery.udp(query, host, self.timeout_s, port)
            except (dns.exception.DNSException, OSError) as exc:
                log.debug("dns upstream %s:%d: %s", host, port, exc)
        return _reply(query, dns.rcode.SERVFAIL)


def _reply(query: dns.message.Message, rcode: dns.rcode.Rcode) -> dns.message.Message:
    reply = dns.message.make_response(query)
    reply.set_rcode(rcode)
    return reply


def learned_addresses(answer: dns.message.Message) -> dict[ipaddress.IPv4Address, int]:
    """Every A record of an answer (CNAME chains included) with how long to allow it."""
    out: dict[ipaddress.IPv4Address, int] = {}
    for rrset in answer.answer:
        if rrset.rdtype != dns.rdatatype.A:
            continue
        keep = min(max(int(rrset.ttl), MIN_LEARNED_S) + LEARN_GRACE_S, MAX_LEARNED_S)
        for rd in rrset:
            ip = ipaddress.IPv4Address(rd.address)
            out[ip] = max(out.get(ip, 0), keep)
    return out


class SlotDns:
    """Port 53 (UDP and TCP) on one slot's gateway, answering by the slot's current policy."""

    def __init__(
        self,
        netns_path: Path,
        gateway: str,
        forwarder: DnsForwarder,
        policy: Callable[[], Egress],
        learn: Learn,
    ) -> None:
        self.netns_path = netns_path
        self.gateway = gateway
        self.forwarder = forwarder
        self.policy = policy
        self.learn = learn
        self._udp: asyncio.DatagramTransport | None = None
        self._tcp: asyncio.Server | None = None
        self._inflight = 0
        self._tcp_conns = asyncio.Semaphore(MAX_TCP_CONNECTIONS)
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        where = self.netns_path
        udp = await socket_in(where, socket.SOCK_DGRAM, bind=(self.gateway, DNS_PORT))
        try:
            transport, _ = await loop.create_datagram_endpoint(lambda: _Udp(self), sock=udp)
            self._udp = transport
            tcp = await socket_in(where, bind=(self.gateway, DNS_PORT), reuse=True)
            tcp.listen(MAX_TCP_CONNECTIONS)
            self._tcp = await asyncio.start_server(self._serve_tcp, sock=tcp)
        except BaseException:
            await self.close()
            raise

    async def close(self) -> None:
        """Stop listening; returns once the port is free again (the next guest on this slot
        binds it at once)."""
        if self._udp is not None:
            closed = self._udp.get_protocol()
            self._udp.close()
            self._udp = None
            if isinstance(closed, _Udp):
                # The transport closes its socket on a later loop turn.
                async with asyncio.timeout(5):
                    await closed.closed.wait()
        if self._tcp is not None:
            self._tcp.close()
            self._tcp = None
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def answer(self, wire: bytes, *, tcp: bool) -> bytes | None:
        """The reply to one query in wire form; None for something that is not a query."""
        try:
            query = dns.message.from_wire(wire)
        except dns.exception.DNSException:
            return None
        if query.flags & dns.flags.QR:
            return None
        if query.opcode() != dns.opcode.QUERY or len(query.question) != 1:
            return _reply(query, dns.rcode.NOTIMP).to_wire()
        name = query.question[0].name.to_text(omit_final_dot=True)
        policy = self.policy()
        verdict = policy.dns_verdict(name)
        if verdict is DnsVerdict.REFUSED:
            return _reply(query, dns.rcode.REFUSED).to_wire()
        if verdict is DnsVerdict.NXDOMAIN:
            return _reply(query, dns.rcode.NXDOMAIN).to_wire()
        reply = await self.forwarder.resolve(query, tcp=tcp)
        if policy.learns(name):
            found = learned_addresses(reply)
            if found:
                try:
                    # Before the guest has the answer: its connect follows at once.
                    await self.learn(found)
                except Exception as exc:
                    log.warning("dns: cannot allow the addresses of %s: %s", name, exc)
        return reply.to_wire()

    async def _udp_query(self, wire: bytes, addr: tuple[str, int]) -> None:
        try:
            out = await self.answer(wire, tcp=False)
            if out is not None and self._udp is not None:
                self._udp.sendto(out, addr)
        finally:
            self._inflight -= 1

    def datagram(self, wire: bytes, addr: tuple[str, int]) -> None:
        if self._inflight >= MAX_INFLIGHT:
            return
        self._inflight += 1
        self._spawn(self._udp_query(wire, addr))

    async def _serve_tcp(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._tcp_conns.locked():
            writer.close()
            return
        async with self._tcp_conns:
            try:
                while True:
                    async with asyncio.timeout(TCP_IDLE_S):
                        size = int.from_bytes(await reader.readexactly(2), "big")
                        wire = await reader.readexactly(size)
                    out = await self.answer(wire, tcp=True)
                    if out is None:
                        break
                    writer.write(len(out).to_bytes(2, "big") + out)
                    await writer.drain()
            except (TimeoutError, asyncio.IncompleteReadError, ConnectionError):
                pass
            finally:
                writer.close()


class _Udp(asyncio.DatagramProtocol):
    def __init__(self, owner: SlotDns) -> None:
        self.owner = owner
        self.closed = asyncio.Event()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed.set()

    def datagram_received(self, data: bytes, addr: tuple[str | int, int]) -> None:
        self.owner.datagram(data, (str(addr[0]), int(addr[1])))
