"""The slot DNS forwarder's answers (`network.dns`), against a real resolver on loopback."""

from __future__ import annotations

import ipaddress
import socket
import time
from pathlib import Path

import dns.message
import dns.rcode
import pytest
from resolver import TestResolver

from agentenv.network.dns import DnsForwarder, SlotDns, learned_addresses, parse_upstream
from agentenv.network.egress import OPEN, Egress
from agentenv.network.errors import NetworkError


def query(name: str) -> bytes:
    return dns.message.make_query(name, "A").to_wire()


def make(resolver_address: str, policy: Egress) -> tuple[SlotDns, list[dict[str, int]]]:
    learned: list[dict[str, int]] = []

    async def learn(found: dict[ipaddress.IPv4Address, int]) -> None:
        learned.append({str(k): v for k, v in found.items()})

    fwd = DnsForwarder([resolver_address], timeout_s=0.5)
    return SlotDns(Path("/nonexistent"), "169.254.0.1", fwd, lambda: policy, learn), learned


def rcode(wire: bytes | None) -> dns.rcode.Rcode:
    assert wire is not None
    return dns.message.from_wire(wire).rcode()


async def test_open_policy_forwards_and_learns_nothing() -> None:
    with TestResolver({"inet.test": ["198.51.100.2"]}) as r:
        slot_dns, learned = make(r.address, OPEN)
        reply = dns.message.from_wire(await slot_dns.answer(query("inet.test"), tcp=False) or b"")
        assert [rd.address for rd in reply.answer[0]] == ["198.51.100.2"]
        assert rcode(await slot_dns.answer(query("nope.test"), tcp=True)) == dns.rcode.NXDOMAIN
        assert learned == [] and r.queries["inet.test"] == 1


async def test_allowed_names_are_learned_before_the_answer_and_denied_ones_do_not_exist() -> None:
    policy = Egress.of(deny_out=["0.0.0.0/0"], allow_out=["inet.test", "*.ok.test"])
    with TestResolver({"inet.test": ["198.51.100.2"], "a.ok.test": ["198.51.100.7"]}) as r:
        r.set("other.test", "198.51.100.130")
        slot_dns, learned = make(r.address, policy)
        assert rcode(await slot_dns.answer(query("inet.test"), tcp=False)) == dns.rcode.NOERROR
        assert rcode(await slot_dns.answer(query("a.ok.test"), tcp=False)) == dns.rcode.NOERROR
        assert learned == [{"198.51.100.2": 90}, {"198.51.100.7": 90}]
        # Not allowed, yet resolvable: an allowed CIDR or the SNI check decides the connect.
        assert rcode(await slot_dns.answer(query("other.test"), tcp=False)) == dns.rcode.NOERROR
        assert len(learned) == 2

    deny = Egress.of(deny_out=["blocked.test"])
    with TestResolver({"blocked.test": ["198.51.100.9"]}) as r:
        slot_dns, _ = make(r.address, deny)
        assert rcode(await slot_dns.answer(query("blocked.test"), tcp=False)) == dns.rcode.NXDOMAIN
        assert r.queries["blocked.test"] == 0  # never asked upstream


async def test_nothing_resolves_without_internet() -> None:
    with TestResolver({"inet.test": ["198.51.100.2"]}) as r:
        slot_dns, _ = make(r.address, Egress(internet=False))
        assert rcode(await slot_dns.answer(query("inet.test"), tcp=False)) == dns.rcode.REFUSED
        assert sum(r.queries.values()) == 0


async def test_a_dead_upstream_is_servfail_within_the_deadline() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as silent:
        silent.bind(("127.0.0.1", 0))  # receives, never answers
        slot_dns, _ = make(f"127.0.0.1:{silent.getsockname()[1]}", OPEN)
        t0 = time.monotonic()
        assert rcode(await slot_dns.answer(query("inet.test"), tcp=False)) == dns.rcode.SERVFAIL
        assert time.monotonic() - t0 < 2.0


async def test_garbage_gets_no_answer() -> None:
    slot_dns, _ = make("127.0.0.1:9", OPEN)
    assert await slot_dns.answer(b"\x00\x01garbage", tcp=False) is None


def test_learned_ttls_and_upstream_syntax() -> None:
    reply = dns.message.from_text(
        "id 1\nflags QR\n;QUESTION\nx.test. IN A\n;ANSWER\n"
        "x.test. 5 IN CNAME y.test.\ny.test. 7200 IN A 198.51.100.3\n"
    )
    assert learned_addresses(reply) == {ipaddress.IPv4Address("198.51.100.3"): 7230}
    assert parse_upstream("127.0.0.1:5353") == ("127.0.0.1", 5353)
    assert parse_upstream("198.51.100.53") == ("198.51.100.53", 53)
    for bad in ("resolver.example", "1.2.3.4:0", "1.2.3.4:x"):
        with pytest.raises(NetworkError):
            parse_upstream(bad)
