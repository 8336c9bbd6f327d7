"""Reading settings from the environment: typed values of `AGENTENV_*` variables (integers,
bounded limits, booleans, on/off switches, paths), the parsing of the composite ones (node
id, gateway bind, etcd endpoints, DNS servers, networks), and `ConfigError` for a value the
platform cannot use. Split from `config.py`, which declares the settings themselves."""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path


class ConfigError(ValueError):
    """A setting has a value the platform cannot use."""


def env_path(name: str, default: Path) -> Path:
    raw = os.environ.get(name)
    return Path(raw).expanduser() if raw else default


def default_cache() -> Path:
    """The shared build cache: `AGENTENV_CACHE`, else ~/.cache/agentenv."""
    return env_path("AGENTENV_CACHE", Path.home() / ".cache" / "agentenv")


def env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError as exc:
        raise ConfigError(f"{name}={raw!r} is not an integer") from exc


def env_bounded(name: str, default: int, most: int) -> int:
    """A limit that is 0 (off) or 1..`most`."""
    value = env_int(name, default)
    if not 0 <= value <= most:
        raise ConfigError(f"{name}={value}: expected 0 (no limit) to {most}")
    return value


def boot_timeout_from_env() -> float | None:
    """AGENTENV_BOOT_TIMEOUT seconds; unset or 0: the accelerator's own deadline."""
    value = env_int("AGENTENV_BOOT_TIMEOUT", 0)
    if value < 0:
        raise ConfigError(f"AGENTENV_BOOT_TIMEOUT={value}: expected seconds (0: by accelerator)")
    return float(value) if value else None


def env_bool(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    value = raw.strip().lower()
    if value in ("1", "true"):
        return True
    if value in ("0", "false"):
        return False
    raise ConfigError(f"{name}={raw!r}: expected 1, 0, true or false")


def env_switch(name: str, default: bool) -> bool:
    """`on`/`off` (and what `env_bool` takes)."""
    raw = (os.environ.get(name) or "").strip().lower()
    if raw in ("on", "yes"):
        return True
    if raw in ("off", "no"):
        return False
    return env_bool(name, default)


def env_opt_path(name: str) -> Path | None:
    raw = os.environ.get(name)
    return Path(raw).expanduser() if raw else None


def default_max_starts() -> int:
    """Concurrent sandbox starts: one per core, at least two (a start mostly waits on QEMU
    and the guest, so two overlap even on one core)."""
    return max(2, os.cpu_count() or 1)


def parse_node_id(raw: str) -> str:
    """A node id is one etcd key part and a DNS label: lowercase letters, digits and '-'."""
    value = raw.strip().lower()
    if not (
        value.isascii() and 0 < len(value) <= 63 and all(c.isalnum() or c == "-" for c in value)
    ):
        raise ConfigError(f"AGENTENV_NODE_ID={raw!r}: expected letters, digits and '-'")
    return value


def gateway_bind_from_env(node_bind: str) -> str:
    """`AGENTENV_NODE_GATEWAY_BIND`, by default the node RPC's host on a free port."""
    raw = os.environ.get("AGENTENV_NODE_GATEWAY_BIND", "").strip()
    if raw == "off":
        return raw
    if not raw:
        return f"{node_bind.rpartition(':')[0] or '127.0.0.1'}:0"
    host, sep, port = raw.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ConfigError(f"AGENTENV_NODE_GATEWAY_BIND={raw!r}: expected HOST:PORT or off")
    return raw


def etcd_endpoints_from_env() -> tuple[str, ...]:
    """AGENTENV_ETCD: `host:port,host:port` (an http:// scheme is dropped)."""
    endpoints: list[str] = []
    for item in os.environ.get("AGENTENV_ETCD", "").split(","):
        text = item.strip().removeprefix("http://").rstrip("/")
        if not text:
            continue
        host, sep, port = text.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(f"AGENTENV_ETCD: {item.strip()!r} is not host:port")
        endpoints.append(f"{host}:{int(port)}")
    return tuple(endpoints)


def dns_servers_from_env() -> tuple[str, ...]:
    """Upstream resolvers of the node's per-slot DNS forwarder (`network.dns`):
    `AGENTENV_DNS` (comma-separated `ip` or `ip:port`), else the host's own IPv4 resolvers,
    loopback ones included (the forwarder asks from the host)."""
    raw = os.environ.get("AGENTENV_DNS")
    if raw is not None:
        servers = [s.strip() for s in raw.split(",") if s.strip()]
        for server in servers:
            host, _, port = server.partition(":")
            try:
                ipaddress.IPv4Address(host)
                if port and not 0 < int(port) < 65536:
                    raise ValueError(port)
            except ValueError as exc:
                raise ConfigError(f"AGENTENV_DNS: {server!r} is not IPv4[:port]") from exc
        return tuple(servers)
    found: list[str] = []
    try:
        lines = Path("/etc/resolv.conf").read_text().splitlines()
    except OSError:
        return ()
    for line in lines:
        parts = line.split()
        if len(parts) >= 2 and parts[0] == "nameserver":
            try:
                addr = ipaddress.ip_address(parts[1])
            except ValueError:
                continue
            if addr.version == 4:
                found.append(str(addr))
    return tuple(found)


def parse_net(name: str, raw: str, max_prefix: int) -> ipaddress.IPv4Network:
    try:
        net = ipaddress.IPv4Network(raw, strict=True)
    except ValueError as exc:
        raise ConfigError(f"{name}={raw!r} is not an IPv4 network: {exc}") from exc
    if net.prefixlen > max_prefix:
        raise ConfigError(f"{name}={raw!r} is too small (need /{max_prefix} or larger)")
    return net
