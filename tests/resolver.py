"""The DNS server tests give the node as its upstream (`AGENTENV_DNS`): authoritative for the
names a test gives it, NXDOMAIN for every other name, never forwarding anywhere. Guests'
lookups in tests end here, never at the host's resolver."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from collections import Counter

import dns.message
import dns.rcode
import dns.rdataclass
import dns.rdatatype
import dns.rrset

TTL = 30


class TestResolver:
    __test__ = False

    def __init__(self, records: dict[str, list[str]] | None = None) -> None:
        self.records: dict[str, list[str]] = {k.lower(): v for k, v in (records or {}).items()}
        self.queries: Counter[str] = Counter()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        # UDP and TCP on one port: the kernel picks a free UDP port, which TCP may hold.
        for _ in range(50):
            udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            udp.bind(("127.0.0.1", 0))
            tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                tcp.bind(("127.0.0.1", udp.getsockname()[1]))
            except OSError:
                udp.close()
                tcp.close()
                continue
            break
        else:
            raise OSError("no port free for both UDP and TCP on 127.0.0.1")
        self._udp, self._tcp = udp, tcp
        self.port = int(udp.getsockname()[1])
        self._tcp.listen(16)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def set(self, name: str, *addresses: str) -> None:
        self.records[name.lower()] = list(addresses)

    def answer(self, wire: bytes) -> bytes:
        query = dns.message.from_wire(wire)
        reply = dns.message.make_response(query)
        reply.flags |= dns.flags.AA
        q = query.question[0]
        name = q.name.to_text(omit_final_dot=True).lower()
        self.queries[name] += 1
        found = self.records.get(name)
        if found is None:
            reply.set_rcode(dns.rcode.NXDOMAIN)
        elif q.rdtype == dns.rdatatype.A and found:
            reply.answer.append(
                dns.rrset.from_text_list(q.name, TTL, dns.rdataclass.IN, dns.rdatatype.A, found)
            )
        return reply.to_wire()

    def __enter__(self) -> TestResolver:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._serve(), self._loop).result(5)
        return self

    async def _serve(self) -> None:
        loop = asyncio.get_running_loop()
        owner = self

        class Udp(asyncio.DatagramProtocol):
            def connection_made(self, transport: asyncio.BaseTransport) -> None:
                self.transport = transport

            def datagram_received(self, data: bytes, addr: tuple[str | int, int]) -> None:
                with contextlib.suppress(Exception):
                    self.transport.sendto(owner.answer(data), addr)  # type: ignore[attr-defined]

        self._udp.setblocking(False)
        self._tcp.setblocking(False)
        await loop.create_datagram_endpoint(Udp, sock=self._udp)

        async def tcp(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            with contextlib.suppress(Exception):
                size = int.from_bytes(await reader.readexactly(2), "big")
                out = owner.answer(await reader.readexactly(size))
                writer.write(len(out).to_bytes(2, "big") + out)
                await writer.drain()
            writer.close()

        self._server = await asyncio.start_server(tcp, sock=self._tcp)

    def __exit__(self, *exc: object) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        self._udp.close()
        self._tcp.close()
