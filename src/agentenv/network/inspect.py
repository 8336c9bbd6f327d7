"""The proxy that decides a guest's web connections by name: TLS SNI or HTTP Host.

A policy that names domains has the slot redirect the guest's new TCP connections to ports
80 and 443 here (nft `redirect` in the slot's namespace; the listener lives there too). For
each one the proxy learns where the guest was going (SO_ORIGINAL_DST), reads the first bytes
the guest sends — a TLS ClientHello or an HTTP request head — and asks the policy about that
name and address. Allowed: it connects from the slot's namespace to the original destination
(so the slot's and host's rules still hold), replays what it read and relays both ways.
Denied: the guest's connection is reset at once.

What cannot be decided by name (no SNI, not HTTP, a client that waits for the server to
speak first) is decided by the destination address alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import re
import socket
import struct
from collections.abc import Callable, Iterable
from pathlib import Path

import h11

from agentenv.network.egress import Egress
from agentenv.network.netns_socket import socket_in
from agentenv.network.nft import INSPECT_PORT
from agentenv.pump import both_ways, stream_flow

log = logging.getLogger(__name__)

SO_ORIGINAL_DST = 80
# The client's first bytes must come this quickly; after that the name is unknown.
HEAD_TIMEOUT_S = 5.0
MAX_HEAD = 64 * 1024
CONNECT_TIMEOUT_S = 10.0
MAX_CONNECTIONS = 1024
CHUNK = 64 * 1024
_METHOD = re.compile(rb"^[A-Z]{1,16}$")
_VERSION = re.compile(rb"^HTTP/\d\.\d$")


def original_destination(sock: socket.socket) -> tuple[ipaddress.IPv4Address, int]:
    raw = sock.getsockopt(socket.SOL_IP, SO_ORIGINAL_DST, 16)
    port, addr = struct.unpack_from("!2xH4s", raw)
    return ipaddress.IPv4Address(addr), int(port)


class _NeedMore(Exception):
    pass


def _u16(data: bytes, at: int) -> int:
    if at + 2 > len(data):
        raise _NeedMore
    return int.from_bytes(data[at : at + 2], "big")


def tls_server_name(data: bytes) -> str | None:
    """The SNI host name of a TLS ClientHello (records reassembled); None if there is none.
    Raises `_NeedMore` while the hello is incomplete."""
    hello = bytearray()
    at = 0
    while True:
        if len(data) < at + 5:
            raise _NeedMore
        if data[at] != 0x16:
            return None
        size = _u16(data, at + 3)
        if len(data) < at + 5 + size:
            raise _NeedMore
        hello += data[at + 5 : at + 5 + size]
        at += 5 + size
        if len(hello) >= 4:
            if hello[0] != 0x01:
                return None
            need = int.from_bytes(hello[1:4], "big")
            if len(hello) >= 4 + need:
                return _sni(bytes(hello[4 : 4 + need]))


def _sni(body: bytes) -> str | None:
    try:
        at = 2 + 32  # client_version, random
        at += 1 + body[at]  # session id
        at += 2 + _u16(body, at)  # cipher suites
        at += 1 + body[at]  # compression methods
        if at >= len(body):
            return None
        end = at + 2 + _u16(body, at)
        at += 2
        while at + 4 <= end:
            kind, size = _u16(body, at), _u16(body, at + 2)
            at += 4
            if kind == 0:  # server_name: a list of (type, name)
                inner = at + 2
                while inner + 3 <= at + size:
                    name_type, length = body[inner], _u16(body, inner + 1)
                    name = body[inner + 3 : inner + 3 + length]
                    if name_type == 0:
                        return name.decode("ascii").lower().rstrip(".")
                    inner += 3 + length
                return None
            at += size
    except (IndexError, _NeedMore, UnicodeDecodeError):
        return None
    return None


def _request_line(line: bytes, *, complete: bool) -> bool:
    """Whether `line` is (or, while incomplete, may become) an HTTP/1 request line: anything
    else is another protocol, decided at once rather than after the head timeout."""
    parts = line.split(b" ")
    if len(parts) > 3 or (complete and len(parts) != 3):
        return False
    method = parts[0]
    if not (_METHOD.match(method) or (not complete and len(parts) == 1 and not method)):
        return False
    if len(parts) < 3:
        return complete is False and len(parts[0]) <= 16
    version = parts[2]
    if complete:
        return bool(_VERSION.match(version))
    return b"HTTP/1.1".startswith(version[:5]) and len(version) <= 8


def http_host(data: bytes) -> str | None:
    """The Host of a plain HTTP request head (port stripped); None if it is not HTTP.
    Raises `_NeedMore` while the head is incomplete."""
    line, crlf, _ = data.partition(b"\r\n")
    if not _request_line(line, complete=bool(crlf)):
        return None
    conn = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD)
    try:
        conn.receive_data(data)
        event = conn.next_event()
    except h11.RemoteProtocolError:
        return None
    if event is h11.NEED_DATA:
        raise _NeedMore
    if not isinstance(event, h11.Request):
        return None
    for key, value in event.headers:
        if key == b"host":
            host = value.decode("ascii", errors="replace").strip().lower()
            if host.startswith("["):
                return None
            return host.rsplit(":", 1)[0] if ":" in host else host
    return None


def name_in(data: bytes) -> str | None:
    """TLS SNI or HTTP Host of the bytes a client sent first (see the two parsers)."""
    if not data:
        raise _NeedMore
    return tls_server_name(data) if data[0] == 0x16 else http_host(data)


def _reset(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    with contextlib.suppress(OSError):
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


class SlotInspector:
    """The listener on one slot's gateway that redirected web connections arrive at."""

    def __init__(
        self,
        netns_path: Path,
        gateway: str,
        policy: Callable[[], Egress],
        never: Iterable[ipaddress.IPv4Network],
    ) -> None:
        self.netns_path = netns_path
        self.gateway = gateway
        self.policy = policy
        # Destinations refused whatever the policy says (the slot ranges, link-local, ...).
        self.never = tuple(never)
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        sock = await socket_in(self.netns_path, bind=(self.gateway, INSPECT_PORT), reuse=True)
        try:
            sock.listen(256)
            self._server = await asyncio.start_server(self._accept, sock=sock, limit=CHUNK)
        except BaseException:
            sock.close()
            raise

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if len(self._tasks) >= MAX_CONNECTIONS:
            _reset(writer)
            return
        task = asyncio.create_task(self._handle(reader, writer))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _read_name(self, reader: asyncio.StreamReader) -> tuple[bytes, str | None]:
        head = b""
        try:
            async with asyncio.timeout(HEAD_TIMEOUT_S):
                while len(head) < MAX_HEAD:
                    chunk = await reader.read(MAX_HEAD - len(head))
                    if not chunk:
                        break
                    head += chunk
                    try:
                        return head, name_in(head)
                    except _NeedMore:
                        continue
        except TimeoutError:
            pass
        return head, None

    async def decide(
        self, reader: asyncio.StreamReader, ip: ipaddress.IPv4Address
    ) -> tuple[bool, bytes, str | None]:
        """(allowed, the bytes read so far, the name asked for)."""
        if any(ip in n for n in self.never):
            return False, b"", None
        policy = self.policy()
        if any(ip in n for n in policy.allowed):
            # Allowed by address: nothing to wait for (servers that speak first work).
            return True, b"", None
        head, name = await self._read_name(reader)
        return self.policy().allows(name, ip), head, name

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        upstream: asyncio.StreamWriter | None = None
        try:
            ip, port = original_destination(writer.get_extra_info("socket"))
            allowed, head, name = await self.decide(reader, ip)
            if not allowed:
                log.info("egress denied: %s:%d (%s)", ip, port, name or "no name")
                _reset(writer)
                return
            sock = await socket_in(self.netns_path)
            try:
                async with asyncio.timeout(CONNECT_TIMEOUT_S):
                    await asyncio.get_running_loop().sock_connect(sock, (str(ip), port))
            except BaseException:
                sock.close()
                raise
            up_reader, upstream = await asyncio.open_connection(sock=sock, limit=CHUNK)
            if head:
                upstream.write(head)
                await upstream.drain()
            await both_ways(
                stream_flow(reader, upstream, CHUNK), stream_flow(up_reader, writer, CHUNK)
            )
        except (OSError, TimeoutError) as exc:
            log.debug("egress relay ended: %s", exc)
            _reset(writer)
        finally:
            if upstream is not None:
                upstream.close()
            writer.close()
