"""Egress policy verdicts (`network.egress`): what nft, the DNS forwarder and the inspecting
proxy each decide from one policy."""

from __future__ import annotations

import ipaddress

import pytest

from agentenv.network.egress import OPEN, BadTarget, DnsVerdict, Egress, matches, parse_targets

IP = ipaddress.IPv4Address


def test_targets_split_into_cidrs_and_domains() -> None:
    nets, names = parse_targets("allowOut", ["1.2.3.4", "10.0.0.0/8", "Example.COM.", "*.pypi.org"])
    assert [str(n) for n in nets] == ["1.2.3.4/32", "10.0.0.0/8"]
    assert names == ("example.com", "*.pypi.org")


@pytest.mark.parametrize(
    ("entry", "says"),
    [
        ("::1", "IPv6"),
        ("localhost", "domain name"),
        ("1.2.3", "not a valid"),
        ("bad_-.example..com", "domain name"),
        ("bücher.example", "punycode"),
        ("a" * 64 + ".com", "domain name"),
    ],
)
def test_bad_targets_are_named(entry: str, says: str) -> None:
    with pytest.raises(BadTarget, match=says) as err:
        parse_targets("network.allowOut", [entry])
    assert "network.allowOut" in str(err.value)


def test_too_many_targets_and_dns_servers_are_refused() -> None:
    with pytest.raises(BadTarget, match="at most 256"):
        parse_targets("denyOut", [f"10.0.{i // 256}.{i % 256}" for i in range(257)])
    with pytest.raises(BadTarget, match="dnsServers"):
        Egress.of(dns_servers=["resolver.example"])
    with pytest.raises(BadTarget, match="at most 10"):
        Egress.of(dns_servers=[f"198.51.100.{i}" for i in range(11)])


def test_wildcards_cover_names_below_only() -> None:
    assert matches("a.b.example.com", ["*.example.com"])
    assert not matches("example.com", ["*.example.com"])
    assert not matches("badexample.com", ["*.example.com"])
    assert matches("EXAMPLE.com.", ["example.com"])


def test_allow_wins_and_internet_off_denies_the_rest() -> None:
    only = Egress.of(internet=False, allow_out=["api.example.com", "198.51.100.0/25"])
    assert only.allows("api.example.com", IP("203.0.113.9"))
    assert not only.allows("other.example.com", IP("203.0.113.9"))
    assert only.allows("other.example.com", IP("198.51.100.3"))  # allowed by address
    assert not only.allows(None, IP("203.0.113.9"))
    assert only.inspects


def test_deny_by_domain_leaves_everything_else_open() -> None:
    deny = Egress.of(deny_out=["*.blocked.example"])
    assert not deny.open and deny.inspects
    assert not deny.allows("x.blocked.example", IP("203.0.113.9"))
    assert deny.allows("fine.example", IP("203.0.113.9"))
    assert deny.allows(None, IP("203.0.113.9"))
    assert deny.dns_verdict("x.blocked.example") is DnsVerdict.NXDOMAIN
    assert deny.dns_verdict("fine.example") is DnsVerdict.FORWARD
    assert not deny.learns("fine.example")


def test_dns_follows_what_may_be_reached() -> None:
    assert Egress(internet=False).dns_verdict("any.example") is DnsVerdict.REFUSED
    closed_but_one_ip = Egress.of(internet=False, allow_out=["198.51.100.2"])
    assert closed_but_one_ip.dns_verdict("any.example") is DnsVerdict.FORWARD
    names = Egress.of(deny_out=["0.0.0.0/0"], allow_out=["inet.test"])
    assert names.dns_verdict("inet.test") is DnsVerdict.FORWARD
    assert names.learns("inet.test") and not names.learns("other.test")
    assert OPEN.dns_verdict("any.example") is DnsVerdict.FORWARD
    assert not OPEN.learns("any.example")


def test_dns_servers_open_only_with_a_domain_allowed() -> None:
    assert Egress.of(internet=False, allow_out=["1.2.3.4"]).allowed == (
        ipaddress.IPv4Network("1.2.3.4/32"),
    )
    default = Egress.of(internet=False, allow_out=["inet.test"])
    assert default.allows_ip(IP("8.8.8.8"))  # E2B's default nameserver
    none = Egress.of(internet=False, allow_out=["inet.test"], dns_servers=[])
    assert not none.allows_ip(IP("8.8.8.8"))
    own = Egress.of(internet=False, allow_out=["inet.test"], dns_servers=["198.51.100.53"])
    assert own.allows_ip(IP("198.51.100.53")) and not own.allows_ip(IP("8.8.8.8"))


def test_json_round_trip_keeps_domains_and_servers() -> None:
    e = Egress.of(
        internet=False,
        allow_out=["inet.test", "198.51.100.0/24"],
        deny_out=["*.bad.test"],
        dns_servers=["198.51.100.53"],
    )
    assert Egress.from_json(e.to_json()) == e
    assert Egress.from_json(None) == OPEN
    assert Egress.from_json(False) == Egress(internet=False)
