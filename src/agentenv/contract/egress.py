"""A sandbox's egress policy: internet on or off, destinations allowed or denied by CIDR or
by domain name, and the verdicts every enforcing part (nft, the slot's DNS forwarder, the
domain-inspecting proxy) takes from it.

E2B's semantics: `allow_out` wins over `deny_out`; internet off is `deny_out` 0.0.0.0/0. A
denied connection is refused at once (TCP reset, ICMP admin-prohibited otherwise), never
dropped into a silent hang.

A value of the contract (a `SandboxSpec` carries it), so it imports only the standard library:
importing the contract loads no network code. `network.egress` re-exports it for the node side.

Domain entries (`example.com`, `*.example.com` for every name under it) are matched by name:
on TCP ports 80 and 443 the name is the request's HTTP Host or TLS SNI (`network.inspect`);
on every other port the addresses the slot's DNS forwarder (`network.dns`) returned for an
allowed name are allowed for as long as the answer lives, and a denied name does not resolve.
`dns_servers` are the resolvers a guest may reach itself when `allow_out` names a domain
(E2B's default is 8.8.8.8); the slot's own forwarder is always reachable.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum
from typing import Any

# More entries than this is a mistake, and every CIDR entry is an nft rule.
MAX_TARGETS = 256
MAX_DNS_SERVERS = 10
EVERYWHERE = ipaddress.IPv4Network("0.0.0.0/0")
# E2B opens this resolver when `allow_out` names a domain and `dns_servers` is left out.
DEFAULT_DNS_SERVERS = (ipaddress.IPv4Address("8.8.8.8"),)
_LABEL = re.compile(r"^(?!-)[a-z0-9_-]{1,63}(?<!-)$")


class BadTarget(ValueError):
    """An allow/deny entry this server cannot enforce or parse."""


def _domain(field: str, entry: str) -> str:
    name = entry.strip().lower().rstrip(".")
    bare = name[2:] if name.startswith("*.") else name
    if not name.isascii():
        raise BadTarget(f"{field}: {entry!r}: give internationalized names in punycode")
    labels = bare.split(".")
    if len(bare) > 253 or len(labels) < 2 or not all(_LABEL.match(x) for x in labels):
        raise BadTarget(
            f"{field}: {entry!r} is neither an IPv4 address or CIDR nor a domain name "
            "(name.example or *.example)"
        )
    if labels[-1].isdigit():
        raise BadTarget(f"{field}: {entry!r} is not a valid IPv4 address, CIDR or domain name")
    return name


def parse_targets(
    field: str, entries: Iterable[str]
) -> tuple[tuple[ipaddress.IPv4Network, ...], tuple[str, ...]]:
    """IPv4 CIDRs or addresses, and domain names; anything else raises `BadTarget` naming
    `field` and the entry."""
    nets: list[ipaddress.IPv4Network] = []
    names: list[str] = []
    for entry in entries:
        try:
            net = ipaddress.ip_network(entry.strip(), strict=False)
        except ValueError:
            name = _domain(field, entry)
            if name not in names:
                names.append(name)
            continue
        if not isinstance(net, ipaddress.IPv4Network):
            raise BadTarget(f"{field}: {entry!r}: guests have no IPv6, so it cannot apply")
        nets.append(net)
    if len(nets) + len(names) > MAX_TARGETS:
        raise BadTarget(f"{field}: at most {MAX_TARGETS} entries, got {len(nets) + len(names)}")
    return tuple(nets), tuple(names)


def parse_dns_servers(field: str, entries: Iterable[str]) -> tuple[ipaddress.IPv4Address, ...]:
    out: list[ipaddress.IPv4Address] = []
    for entry in entries:
        try:
            out.append(ipaddress.IPv4Address(entry.strip()))
        except ValueError:
            raise BadTarget(f"{field}: {entry!r} is not an IPv4 address") from None
    if len(out) > MAX_DNS_SERVERS:
        raise BadTarget(f"{field}: at most {MAX_DNS_SERVERS} entries, got {len(out)}")
    return tuple(out)


def matches(name: str, patterns: Iterable[str]) -> bool:
    """Whether `name` is one of `patterns` (`*.x.y` covers every name below x.y)."""
    name = name.lower().rstrip(".")
    for p in patterns:
        if p.startswith("*."):
            if name.endswith(p[1:]):
                return True
        elif name == p:
            return True
    return False


class DnsVerdict(Enum):
    FORWARD = "forward"
    # The name is denied: it does not exist for this guest.
    NXDOMAIN = "nxdomain"
    # Nothing at all is allowed: no name resolves (no lookups leave through us either).
    REFUSED = "refused"


@dataclass(frozen=True)
class Egress:
    internet: bool = True
    allow_out: tuple[ipaddress.IPv4Network, ...] = ()
    deny_out: tuple[ipaddress.IPv4Network, ...] = ()
    allow_domains: tuple[str, ...] = ()
    deny_domains: tuple[str, ...] = ()
    # None: the request left it out (E2B's default applies).
    dns_servers: tuple[ipaddress.IPv4Address, ...] | None = None

    @property
    def open(self) -> bool:
        """Nothing restricted (the slot's default: no rules needed)."""
        return self.internet and not self.deny_out and not self.deny_domains

    @property
    def inspects(self) -> bool:
        """Whether ports 80/443 go through the domain-inspecting proxy."""
        return not self.open and bool(self.allow_domains or self.deny_domains)

    @property
    def denied(self) -> tuple[ipaddress.IPv4Network, ...]:
        return (*self.deny_out, EVERYWHERE) if not self.internet else self.deny_out

    @property
    def allowed(self) -> tuple[ipaddress.IPv4Network, ...]:
        """`allow_out` CIDRs, plus the resolvers opened because a domain is allowed."""
        if not self.allow_domains:
            return self.allow_out
        servers = DEFAULT_DNS_SERVERS if self.dns_servers is None else self.dns_servers
        return (*self.allow_out, *(ipaddress.IPv4Network(s) for s in servers))

    def _denies_everything(self) -> bool:
        return any(n.prefixlen == 0 for n in self.denied)

    def allows_ip(self, ip: ipaddress.IPv4Address) -> bool:
        """The verdict for a connection known only by its destination address."""
        if any(ip in n for n in self.allowed):
            return True
        return not any(ip in n for n in self.denied)

    def allows(self, name: str | None, ip: ipaddress.IPv4Address) -> bool:
        """The verdict for a connection to `ip` that asked for `name` (HTTP Host, TLS SNI)."""
        if name is not None and matches(name, self.allow_domains):
            return True
        if any(ip in n for n in self.allowed):
            return True
        if name is not None and matches(name, self.deny_domains):
            return False
        return self.allows_ip(ip)

    def dns_verdict(self, name: str) -> DnsVerdict:
        if matches(name, self.allow_domains):
            return DnsVerdict.FORWARD
        if matches(name, self.deny_domains):
            return DnsVerdict.NXDOMAIN
        if self._denies_everything() and not self.allowed:
            return DnsVerdict.REFUSED
        return DnsVerdict.FORWARD

    def learns(self, name: str) -> bool:
        """Whether the addresses `name` resolves to become allowed destinations."""
        return not self.open and matches(name, self.allow_domains)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "internet": self.internet,
            "allow_out": [str(n) for n in self.allow_out] + list(self.allow_domains),
            "deny_out": [str(n) for n in self.deny_out] + list(self.deny_domains),
        }
        if self.dns_servers is not None:
            out["dns_servers"] = [str(s) for s in self.dns_servers]
        return out

    @classmethod
    def from_json(cls, raw: Any) -> Egress:
        """From `to_json`'s form; also a bare bool (internet on/off) or None (open)."""
        if raw is None:
            return cls()
        if isinstance(raw, bool):
            return cls(internet=raw)
        return cls.of(
            internet=bool(raw.get("internet", True)),
            allow_out=raw.get("allow_out", []),
            deny_out=raw.get("deny_out", []),
            dns_servers=raw.get("dns_servers"),
        )

    @classmethod
    def of(
        cls,
        *,
        internet: bool = True,
        allow_out: Iterable[str] = (),
        deny_out: Iterable[str] = (),
        dns_servers: Iterable[str] | None = None,
        prefix: str = "",
    ) -> Egress:
        """From the API's lists (raises `BadTarget` naming `prefix`+field and the entry)."""
        allow_nets, allow_names = parse_targets(f"{prefix}allowOut", allow_out)
        deny_nets, deny_names = parse_targets(f"{prefix}denyOut", deny_out)
        servers = (
            None if dns_servers is None else parse_dns_servers(f"{prefix}dnsServers", dns_servers)
        )
        return cls(internet, allow_nets, deny_nets, allow_names, deny_names, servers)


OPEN = Egress()
