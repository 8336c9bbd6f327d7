"""The control plane's persistent state: sandbox rows, lifecycle log lines, teams, API keys and
idempotency keys, as value types and one async interface (`Store`) with two implementations:

- `sqlite_store.SqliteStore`: one SQLite file per server, the single-node default;
- `etcd_store.EtcdStore`: the same rows in etcd (`AGENTENV_ETCD`), shared by every
  control-plane replica.

Async because a replicated store answers over the network: every caller awaits, so which one
the server runs on changes nothing above this interface.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Protocol


class SandboxState(StrEnum):
    CREATING = "creating"
    RUNNING = "running"
    PAUSING = "pausing"
    PAUSED = "paused"
    RESUMING = "resuming"
    KILLING = "killing"
    GONE = "gone"


# Live = still holds (or is about to hold) resources on a node.
LIVE_STATES = frozenset(SandboxState) - {SandboxState.GONE}
# Metadata key on a template build's sandbox (its value: the build id). Such a sandbox is
# admitted, reaped and recovered like any other, but it is the server's, not a user's: the
# sandbox lists and the user-facing counts leave it out.
BUILD_METADATA = "agentenv.build"
# The team every key, sandbox and snapshot made before teams existed belongs to (and the
# first key's): a single-user server never sees another.
DEFAULT_TEAM = "default"
# States in which a sandbox holds a VM or is about to (a team's concurrency counts these;
# a paused sandbox is only disk, a killing one is on its way out).
ACTIVE_STATES = frozenset(
    {SandboxState.CREATING, SandboxState.RUNNING, SandboxState.PAUSING, SandboxState.RESUMING}
)


@dataclass
class SandboxRecord:
    id: str
    template: str
    alias: str
    state: SandboxState
    started_at: float
    end_at: float
    cpu: int
    memory_mb: int
    disk_mb: int
    envd_version: str
    metadata: dict[str, str] = field(default_factory=dict)
    env_vars: dict[str, str] = field(default_factory=dict)
    envd_token: str | None = None
    traffic_token: str | None = None
    auto_pause: bool = False
    auto_resume: bool = False
    allow_internet: bool = True
    network: dict[str, Any] = field(default_factory=dict)
    address: str | None = None
    # Set when the sandbox first runs and kept from then on: None for a create that failed.
    envd_url: str | None = None
    api_key_id: str | None = None
    # The owning team: only its keys see or touch the sandbox.
    team_id: str = DEFAULT_TEAM
    # False: an auto-pause (timeout with `auto_pause`) keeps only the disk (E2B's
    # `autoPauseMemory: false`).
    auto_pause_memory: bool = True
    # What the last pause of a paused sandbox kept: "full" (memory and disk) or
    # "filesystem" (disk only; the resume cold-boots); None while not paused.
    pause_mode: str | None = None
    # On a store shared by control-plane replicas: the replica that moved the row into its
    # current (or last) transitional state, i.e. the one running that operation. A row left
    # transitional by a replica that is no longer alive is settled by another one
    # (`SandboxManager.sweep_orphans`). None on one server, and from older replicas.
    replica_id: str | None = None
    # The cluster node it runs (or last ran) on, as its placement said; None on one server.
    # The proxy reaches `address` through that node's data gateway.
    node_id: str | None = None
    # After its timeout, paused (memory kept) for this long, then deleted (0: the timeout
    # kills, or pauses for the retention limit with `auto_pause`): a late scorer can still
    # connect and read it.
    grace_s: int = 0
    # When the grace period of its last timeout pause ends (0: not paused by one). Only a
    # pause at or after the latest `end_at` counts: a later resume and pause move `end_at`
    # past it.
    grace_until: float = 0.0
    # Killed once no client has touched it (an API call on it, proxied traffic) for this
    # long (0: off): the dead man's switch of a client that went away.
    keepalive_s: int = 0
    # The last touch stored (each replica flushes what its own API and proxy saw).
    seen_at: float = 0.0
    # While a reset runs (state `resuming`): the template or snapshot reference the node
    # starts the sandbox from, so a recovery can finish a reset cut short. None otherwise.
    reset_to: str | None = None
    # A fork's child: the capture it started from (a snapshot id on its node), which a reset
    # with no target goes back to (its `template` stays its parent's, as the API shows it).
    # None: its template's state.
    origin: str | None = None
    seq: int = 0

    @property
    def allow_public_traffic(self) -> bool:
        return bool(self.network.get("allowPublicTraffic", True))

    def grace_left(self, now: float) -> float:
        """Seconds left of the grace period a timeout pause put it in (0: not in one)."""
        if self.state is not SandboxState.PAUSED or self.grace_until < self.end_at:
            return 0.0
        return max(0.0, self.grace_until - now)


@dataclass(frozen=True)
class ApiKey:
    id: str
    name: str
    prefix: str
    created_at: float
    revoked_at: float | None
    team_id: str = DEFAULT_TEAM


@dataclass(frozen=True)
class Team:
    id: str
    name: str
    created_at: float
    # 0 = no limit (the node's own admission limits still apply).
    max_sandboxes: int = 0
    creates_per_minute: int = 0


@dataclass(frozen=True)
class LogLine:
    sandbox_id: str
    ts: float
    level: str
    message: str


class Store(Protocol):
    """What the control plane keeps. Every sandbox state change is a compare-and-set: of two
    writers (tasks, or replicas on a shared store) moving one sandbox from the same state,
    exactly one `transition` returns True."""

    async def open(self) -> None:
        """Begin the store's own background work on the running loop (SQLite: its WAL
        checkpoints); `close` ends it."""

    async def close(self) -> None: ...

    # Sandboxes. `insert` sets `rec.seq`: increasing in insertion order (the list order).
    # A `note` is a lifecycle log line (level info) written with the row, in the same write:
    # by `insert` always, by `transition` only if the row moved.
    async def insert(self, rec: SandboxRecord, *, note: str | None = None) -> None: ...
    async def get(self, sandbox_id: str) -> SandboxRecord | None: ...
    # The row as this process knows it without reading the store, None when it does not:
    # its own writes at once, other replicas' as they reach it (milliseconds). For the
    # proxy's per-request lookup; anything that decides reads `get`.
    def recent(self, sandbox_id: str) -> SandboxRecord | None: ...
    async def transition(
        self,
        sandbox_id: str,
        expected: SandboxState | Iterable[SandboxState],
        new: SandboxState,
        *,
        note: str | None = None,
        **changes: Any,
    ) -> bool: ...
    async def update(self, sandbox_id: str, **changes: Any) -> None: ...
    # Takes over the operation of a row still in `state` and still stamped `was` (None: no
    # stamp) by stamping it `replica_id`; of two replicas taking it over, one returns True.
    async def claim(
        self, sandbox_id: str, state: SandboxState, was: str | None, replica_id: str
    ) -> bool: ...
    async def select(
        self,
        states: Iterable[SandboxState] | None = None,
        *,
        after_seq: int = 0,
        descending: bool = False,
        before_seq: int | None = None,
        team_id: str | None = None,
    ) -> list[SandboxRecord]: ...
    async def envd_tokens(self) -> list[tuple[str, str]]: ...
    async def expired(self, now: float) -> list[SandboxRecord]: ...
    async def next_deadline(self) -> float | None: ...
    async def count_by_state(self) -> dict[str, int]: ...
    async def count_active(self, team_id: str) -> tuple[int, float | None]: ...
    async def count_builds(self) -> int: ...
    async def spawns(self, team_id: str | None = None) -> dict[str, tuple[int, float]]: ...

    # Lifecycle log lines.
    async def log(self, sandbox_id: str, message: str, level: str = "info") -> None: ...
    async def logs(
        self, sandbox_id: str, *, start: float = 0.0, limit: int = 1000
    ) -> list[LogLine]: ...

    # Teams and snapshot owners.
    async def add_team(self, team_id: str, name: str) -> Team: ...
    async def team(self, ref: str) -> Team | None: ...
    async def teams(self) -> list[Team]: ...
    async def set_team_limits(
        self, team_id: str, *, max_sandboxes: int | None, creates_per_minute: int | None
    ) -> bool: ...
    async def set_snapshot_owner(self, snapshot_id: str, team_id: str) -> None: ...
    async def snapshot_owner(self, snapshot_id: str) -> str: ...

    # API keys.
    async def add_key(
        self, key_id: str, name: str, prefix: str, key_hash: str, team_id: str = DEFAULT_TEAM
    ) -> ApiKey: ...
    # The store's first key, atomically: None if it has (or, on etcd, ever had) one, so of
    # replicas starting together on an empty store exactly one makes it.
    async def add_first_key(
        self, key_id: str, name: str, prefix: str, key_hash: str, team_id: str = DEFAULT_TEAM
    ) -> ApiKey | None: ...
    async def key_by_hash(self, key_hash: str) -> ApiKey | None: ...
    async def key(self, key_id: str) -> ApiKey | None: ...
    async def keys(self) -> list[ApiKey]: ...
    async def revoke_key(self, key_id: str) -> bool: ...

    # Idempotency keys.
    async def claim_idempotency(self, api_key_id: str, key: str, body_hash: str) -> bool: ...
    async def idempotency(self, api_key_id: str, key: str) -> tuple[str, str | None] | None: ...
    async def complete_idempotency(self, api_key_id: str, key: str, sandbox_id: str) -> None: ...
    async def release_idempotency(self, api_key_id: str, key: str) -> None: ...
    async def expire_idempotency(self, older_than: float) -> None: ...
