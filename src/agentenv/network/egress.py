"""A sandbox's egress policy: internet on or off, and destinations allowed or denied by CIDR.

E2B's semantics: `allow_out` wins over `deny_out`; internet off is `deny_out` 0.0.0.0/0. A
denied connection is refused at once (TCP reset, ICMP admin-prohibited otherwise), never
dropped into a silent hang. Domain names are not enforced here (that needs SNI/Host
inspection and a resolver of ours): `parse_targets` refuses them, naming the entry.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

# More entries than this is a mistake, and every entry is an nft rule.
MAX_TARGETS = 256
EVERYWHERE = ipaddress.IPv4Network("0.0.0.0/0")


class BadTarget(ValueError):
    """An allow/deny entry this server cannot enforce or parse."""


def parse_targets(field: str, entries: Iterable[str]) -> tuple[ipaddress.IPv4Network, ...]:
    """IPv4 CIDRs or addresses; anything else raises `BadTarget` naming `field` and the entry."""
    out: list[ipaddress.IPv4Network] = []
    for entry in entries:
        try:
            net = ipaddress.ip_network(entry.strip(), strict=False)
        except ValueError:
            raise BadTarget(
                f"{field}: {entry!r} is not an IPv4 address or CIDR (domain names are not "
                "enforced by this server yet)"
            ) from None
        if not isinstance(net, ipaddress.IPv4Network):
            raise BadTarget(f"{field}: {entry!r}: guests have no IPv6, so it cannot apply")
        out.append(net)
    if len(out) > MAX_TARGETS:
        raise BadTarget(f"{field}: at most {MAX_TARGETS} entries, got {len(out)}")
    return tuple(out)


@dataclass(frozen=True)
class Egress:
    internet: bool = True
    allow_out: tuple[ipaddress.IPv4Network, ...] = ()
    deny_out: tuple[ipaddress.IPv4Network, ...] = ()

    @property
    def open(self) -> bool:
        """Nothing restricted (the slot's default: no rules needed)."""
        return self.internet and not self.deny_out

    @property
    def denied(self) -> tuple[ipaddress.IPv4Network, ...]:
        return (*self.deny_out, EVERYWHERE) if not self.internet else self.deny_out

    def to_json(self) -> dict[str, Any]:
        return {
            "internet": self.internet,
            "allow_out": [str(n) for n in self.allow_out],
            "deny_out": [str(n) for n in self.deny_out],
        }

    @classmethod
    def from_json(cls, raw: Any) -> Egress:
        """From `to_json`'s form; also a bare bool (internet on/off) or None (open)."""
        if raw is None:
            return cls()
        if isinstance(raw, bool):
            return cls(internet=raw)
        return cls(
            internet=bool(raw.get("internet", True)),
            allow_out=parse_targets("allow_out", raw.get("allow_out", [])),
            deny_out=parse_targets("deny_out", raw.get("deny_out", [])),
        )


OPEN = Egress()
