"""The contract's values to and from their protobuf messages (one function each way)."""

from __future__ import annotations

from typing import Any, Literal

from protobuf import Message

from agentenv.contract.egress import Egress
from agentenv.contract.runtime import (
    Found,
    HostMemory,
    Placement,
    SandboxSpec,
    SnapshotInfo,
)

from .gen import node_pb as pb


def opt_str(msg: Message[Any], name: str) -> str | None:
    """An `optional string` field: None when the sender left it out. (protobuf-py reads an
    unset optional scalar as its zero value; presence is only in `has_field`.)"""
    value = getattr(msg, name)
    return str(value) if msg.has_field(name) else None


def opt_int(msg: Message[Any], name: str) -> int | None:
    value = getattr(msg, name)
    return int(value) if msg.has_field(name) else None


def egress_to_pb(egress: Egress) -> pb.Egress:
    # The policy's own JSON form is its stable external shape: CIDRs and domain names share
    # the allow/deny lists there, and `from_json` re-validates them on the other side.
    raw = egress.to_json()
    servers = raw.get("dns_servers")
    return pb.Egress(
        internet=bool(raw["internet"]),
        allow_out=list(raw["allow_out"]),
        deny_out=list(raw["deny_out"]),
        dns_servers=None if servers is None else pb.DnsServers(servers=list(servers)),
    )


def egress_from_pb(msg: pb.Egress | None) -> Egress:
    if msg is None:
        return Egress()
    raw: dict[str, object] = {
        "internet": msg.internet,
        "allow_out": list(msg.allow_out),
        "deny_out": list(msg.deny_out),
    }
    if msg.dns_servers is not None:
        raw["dns_servers"] = list(msg.dns_servers.servers)
    return Egress.from_json(raw)


def spec_to_pb(spec: SandboxSpec) -> pb.SandboxSpec:
    return pb.SandboxSpec(
        sandbox_id=spec.sandbox_id,
        template=spec.template,
        cpu=spec.cpu,
        memory_mb=spec.memory_mb,
        disk_size_mb=spec.disk_size_mb,
        egress=egress_to_pb(spec.egress),
        env_vars=dict(spec.env_vars),
        envd_token=spec.envd_token,
        metadata=dict(spec.metadata),
        capacity_wait_s=spec.capacity_wait_s,
    )


def spec_from_pb(msg: pb.SandboxSpec | None) -> SandboxSpec:
    if msg is None:
        raise ValueError("request has no sandbox spec")
    return SandboxSpec(
        sandbox_id=msg.sandbox_id,
        template=msg.template,
        cpu=msg.cpu,
        memory_mb=msg.memory_mb,
        disk_size_mb=opt_int(msg, "disk_size_mb"),
        egress=egress_from_pb(msg.egress),
        env_vars=dict(msg.env_vars),
        envd_token=opt_str(msg, "envd_token"),
        metadata=dict(msg.metadata),
        capacity_wait_s=msg.capacity_wait_s if msg.has_field("capacity_wait_s") else None,
    )


def placement_to_pb(p: Placement) -> pb.Placement:
    return pb.Placement(
        sandbox_id=p.sandbox_id,
        address=p.address,
        envd_url=p.envd_url,
        booted=p.booted,
        origin=p.origin,
    )


def placement_from_pb(msg: pb.Placement | None) -> Placement:
    if msg is None:
        raise ValueError("response has no placement")
    return Placement(
        sandbox_id=msg.sandbox_id,
        address=msg.address,
        envd_url=msg.envd_url,
        booted=msg.booted,
        origin=opt_str(msg, "origin"),
    )


def found_to_pb(found: Found) -> pb.Found:
    return pb.Found(
        state=found.state,
        placement=None if found.placement is None else placement_to_pb(found.placement),
        memory=found.memory,
    )


def found_from_pb(msg: pb.Found) -> Found:
    state: Literal["running", "paused"]
    if msg.state == "running":
        state = "running"
    elif msg.state == "paused":
        state = "paused"
    else:
        raise ValueError(f"unknown sandbox state {msg.state!r}")
    placement = None if msg.placement is None else placement_from_pb(msg.placement)
    return Found(state=state, placement=placement, memory=msg.memory)


def snapshot_to_pb(info: SnapshotInfo) -> pb.SnapshotInfo:
    return pb.SnapshotInfo(
        snapshot_id=info.snapshot_id,
        names=list(info.names),
        source=info.source,
        created_at=info.created_at,
        cpu=info.cpu,
        memory_mb=info.memory_mb,
    )


def snapshot_from_pb(msg: pb.SnapshotInfo) -> SnapshotInfo:
    return SnapshotInfo(
        snapshot_id=msg.snapshot_id,
        names=list(msg.names),
        source=msg.source,
        created_at=msg.created_at,
        cpu=msg.cpu,
        memory_mb=msg.memory_mb,
    )


def memory_to_pb(m: HostMemory) -> pb.HostMemory:
    return pb.HostMemory(
        rss=m.rss, pss=m.pss, pss_anon=m.pss_anon, pss_file=m.pss_file, pss_shmem=m.pss_shmem
    )


def memory_from_pb(msg: pb.HostMemory) -> HostMemory:
    return HostMemory(
        rss=msg.rss,
        pss=msg.pss,
        pss_anon=msg.pss_anon,
        pss_file=msg.pss_file,
        pss_shmem=msg.pss_shmem,
    )
