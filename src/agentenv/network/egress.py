"""The egress policy, as the node side's network code names it: the value lives in the contract
(`contract.egress`, stdlib only, so importing the contract loads no network code)."""

from agentenv.contract.egress import (
    DEFAULT_DNS_SERVERS,
    EVERYWHERE,
    MAX_DNS_SERVERS,
    MAX_TARGETS,
    OPEN,
    BadTarget,
    DnsVerdict,
    Egress,
    matches,
    parse_dns_servers,
    parse_targets,
)

__all__ = [
    "DEFAULT_DNS_SERVERS",
    "EVERYWHERE",
    "MAX_DNS_SERVERS",
    "MAX_TARGETS",
    "OPEN",
    "BadTarget",
    "DnsVerdict",
    "Egress",
    "matches",
    "parse_dns_servers",
    "parse_targets",
]
