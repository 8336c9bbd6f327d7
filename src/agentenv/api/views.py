"""JSON shapes the SDK parses: Sandbox, ListedSandbox/SandboxDetail, Template, logs."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from agentenv.build.state import BuildRecord
from agentenv.build.templates import BuiltShape
from agentenv.contract.runtime import HostMemory, TemplateInfo
from agentenv.control.store import BUILD_METADATA, LogLine, SandboxRecord, SandboxState

CLIENT_ID = "agentenv"

# The SDK only accepts "running" and "paused"; transitional states show as where they came from.
_LISTED_STATE = {
    SandboxState.RUNNING: "running",
    SandboxState.PAUSING: "running",
    SandboxState.PAUSED: "paused",
    SandboxState.RESUMING: "paused",
}


_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_MICROSECOND = timedelta(microseconds=1)
# Listable states (the rest are not shown).
LISTED_STATES = frozenset(_LISTED_STATE)


def iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).isoformat().replace("+00:00", "Z")


def micros(ts: float) -> int:
    """``ts`` on the microsecond grid ``iso`` shows it on (the same rounding), so a time a
    client read back compares equal to the one it names."""
    return (datetime.fromtimestamp(ts, UTC) - _EPOCH) // _MICROSECOND


def micros_of(dt: datetime) -> int:
    """An aware datetime (naive: UTC) in whole microseconds since the epoch."""
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=UTC)
    return (dt - _EPOCH) // _MICROSECOND


def iso_micros(us: int) -> str:
    return (_EPOCH + timedelta(microseconds=us)).isoformat().replace("+00:00", "Z")


def listed_state(rec: SandboxRecord) -> str | None:
    if rec.state is SandboxState.RESUMING and rec.reset_to is not None:
        # A reset came from running, and its sandbox stays running to its clients.
        return "running"
    return _LISTED_STATE.get(rec.state)


def user_sandbox(rec: SandboxRecord) -> bool:
    """Not a template build's sandbox: those are the server's, left out of sandbox lists
    (still addressable by id, which only the build log shows)."""
    return BUILD_METADATA not in rec.metadata


def sandbox(rec: SandboxRecord, domain: str | None) -> dict[str, Any]:
    """E2B's Sandbox (create, connect, resume, fork). As upstream's API (its generated
    `api.Sandbox` marks them `omitempty`), a token or domain the sandbox does not have is
    left out, not sent as null: the SDKs then keep no token (no `X-Access-Token`, unsigned
    file URLs), which is what they do for E2B's own unsecured sandboxes."""
    body: dict[str, Any] = {
        "templateID": rec.template,
        "sandboxID": rec.id,
        "clientID": CLIENT_ID,
        "envdVersion": rec.envd_version,
        "envdAccessToken": rec.envd_token,
        "trafficAccessToken": rec.traffic_token,
        "domain": domain,
        "alias": rec.alias,
    }
    return {k: v for k, v in body.items() if v is not None}


def listed(rec: SandboxRecord) -> dict[str, Any]:
    return {
        "templateID": rec.template,
        "sandboxID": rec.id,
        "clientID": CLIENT_ID,
        "alias": rec.alias,
        "startedAt": iso(rec.started_at),
        "endAt": iso(rec.end_at),
        "cpuCount": rec.cpu,
        "memoryMB": rec.memory_mb,
        "diskSizeMB": rec.disk_mb,
        "state": listed_state(rec) or "running",
        "envdVersion": rec.envd_version,
        "metadata": rec.metadata,
    }


def detail(rec: SandboxRecord, domain: str | None) -> dict[str, Any]:
    body = listed(rec)
    body.update(
        {
            "envdAccessToken": rec.envd_token,
            "domain": domain,
            "allowInternetAccess": rec.allow_internet,
            "network": rec.network,
            "lifecycle": {
                "autoResume": rec.auto_resume,
                "onTimeout": "pause" if rec.auto_pause else "kill",
            },
        }
    )
    if rec.state is SandboxState.PAUSED:
        # E2B: what the finished pause kept ("filesystem": the resume boots from disk).
        body["pauseMode"] = rec.pause_mode or "full"
    return body


def host_memory(body: dict[str, Any], mem: HostMemory | None) -> dict[str, Any]:
    """Adds what the sandbox holds on the host (PSS, MiB) when it runs; the SDK keeps fields
    it does not know as additional properties."""
    if mem is not None:
        body["hostMemoryPssMB"] = round(mem.pss / (1024 * 1024), 1)
    return body


def _spawned(spawns: tuple[int, float] | None) -> dict[str, Any]:
    """E2B's spawnCount and lastSpawnedAt from `Store.spawns`."""
    count, last = spawns if spawns is not None else (0, None)
    return {"spawnCount": count, "lastSpawnedAt": iso(last) if last is not None else None}


def template(
    t: TemplateInfo, envd_version: str, spawns: tuple[int, float] | None = None
) -> dict[str, Any]:
    """A catalog template or snapshot in E2B's Template shape (one implicit build)."""
    return {
        "templateID": t.name,
        "buildID": t.name,
        "cpuCount": t.cpu,
        "memoryMB": t.memory_mb,
        "diskSizeMB": t.size_mb,
        "public": False,
        "aliases": [t.name],
        "names": [t.name],
        "createdAt": iso(t.created_at),
        "updatedAt": iso(t.updated_at),
        "createdBy": None,
        **_spawned(spawns),
        "buildCount": 1,
        "envdVersion": envd_version,
        "buildStatus": "ready",
    }


def built_template(
    name: str,
    *,
    build_id: str,
    snapshot: BuiltShape | None,
    disk_mb: int,
    created_at: float,
    updated_at: float,
    spawns: tuple[int, float] | None,
    build_count: int,
    build_status: str,
) -> dict[str, Any]:
    """A template of the build API in E2B's Template shape: shape, disk and envd version
    are those of `snapshot` (its default tag's build), zero/empty when there is none, as
    E2B's list shows a template without a ready default build."""
    return {
        "templateID": name,
        "buildID": build_id,
        "cpuCount": snapshot.cpu if snapshot is not None else 0,
        "memoryMB": snapshot.memory_mb if snapshot is not None else 0,
        "diskSizeMB": disk_mb,
        "public": False,
        "aliases": [name],
        "names": [name],
        "createdAt": iso(created_at),
        "updatedAt": iso(updated_at),
        "createdBy": None,
        **_spawned(spawns),
        "buildCount": build_count,
        "envdVersion": snapshot.envd_version if snapshot is not None else "",
        "buildStatus": build_status,
    }


def template_build(
    rec: BuildRecord, snapshot: BuiltShape | None, *, disk_mb: int | None, cpu: int, memory_mb: int
) -> dict[str, Any]:
    """E2B's TemplateBuild; a ready build's shape is its snapshot's, another's the shape its
    build sandbox was asked for."""
    body: dict[str, Any] = {
        "buildID": rec.build_id,
        "status": rec.status,
        "createdAt": iso(rec.created_at),
        "updatedAt": iso(rec.finished_at or rec.created_at),
        "cpuCount": snapshot.cpu if snapshot is not None else cpu,
        "memoryMB": snapshot.memory_mb if snapshot is not None else memory_mb,
    }
    if rec.finished_at is not None:
        body["finishedAt"] = iso(rec.finished_at)
    if snapshot is not None:
        body["diskSizeMB"] = disk_mb
        body["envdVersion"] = snapshot.envd_version
    return body


def logs_v1(lines: list[LogLine]) -> dict[str, Any]:
    return {
        "logs": [{"timestamp": iso(ln.ts), "line": ln.message} for ln in lines],
        "logEntries": [_entry(ln) for ln in lines],
    }


def logs_v2(lines: list[LogLine]) -> dict[str, Any]:
    return {"logs": [_entry(ln) for ln in lines]}


def _entry(ln: LogLine) -> dict[str, Any]:
    return {
        "timestamp": iso(ln.ts),
        "message": ln.message,
        "level": ln.level,
        "fields": {"sandboxID": ln.sandbox_id},
    }
