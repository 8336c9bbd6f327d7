"""Who runs a sandbox's operation, when control-plane replicas share one store.

A replica that moves a row into a transitional state (creating, pausing, resuming, killing)
stamps it with its replica id (`SandboxRecord.replica_id`). A replica that dies in the middle
leaves the row there; one server would settle it at its next start (`_reconcile`), but a
replica starting beside others cannot tell their operations in flight from a dead one's. The
stamp tells: every replica sweeps now and then (`SandboxManager.sweep_orphans`) for
transitional rows whose replica is not alive (`Replicas.live`, the cluster's leases), and
settles each one as a restarted server would. This module holds what that needs besides the
manager: the replicas' interface, the grace bookkeeping and the log wording.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from agentenv.control.store import SandboxRecord, SandboxState

# The states an operation holds a row in while it runs.
TRANSITIONAL = frozenset(
    {SandboxState.CREATING, SandboxState.PAUSING, SandboxState.RESUMING, SandboxState.KILLING}
)

DEFAULT_SWEEP_PERIOD_S = 2.0
DEFAULT_SWEEP_GRACE_S = 5.0


class Replicas(Protocol):
    """The control-plane replicas sharing the store (`cluster.replicas.ReplicaLease`): this
    process's registration and who else is alive now."""

    replica_id: str
    # Its current etcd lease (0 before it registered): what it holds in the store lives
    # only as long as it does (`control.tenants`' places).
    lease_id: int

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    async def live(self) -> set[str]: ...


@dataclass(frozen=True)
class Settling:
    """The lifecycle log lines of a row settled by someone other than its operation."""

    killed: str
    cut_short: str
    nothing: str
    running: str
    paused: str
    init_failed: str


# One server, at its start: what a previous run of it left (the wording predates replicas).
RESTART = Settling(
    killed="killed (finished after a server restart)",
    cut_short="create cut short by a server restart",
    nothing="the server restarted and found nothing of it",
    running="running, taken over by a restarted server (was {was})",
    paused="paused, as a restarted server found it (was {was})",
    init_failed="envd /init after the restart failed: {exc}",
)


def after_replica(owner: str | None) -> Settling:
    """A live replica, for a row whose replica is gone (or never said who it was)."""
    who = f"its replica {owner}" if owner else "a replica that did not record itself"
    return Settling(
        killed=f"killed (finished after {who} was gone)",
        cut_short=f"create cut short: {who} was gone",
        nothing=f"{who} was gone, and its node holds nothing of it",
        running=f"running, taken over after {who} was gone (was {{was}})",
        paused=f"paused, as found after {who} was gone (was {{was}})",
        init_failed="envd /init after the takeover failed: {exc}",
    )


class Orphans:
    """Rows seen without a live replica, and since when (this process's monotonic clock).

    A row is due once it has been seen orphaned, in the same state with the same stamp, for
    `grace_s`: long enough that a replica whose lease flapped (etcd slow, the process paused)
    has registered again, and that a node call its dead caller left has been cancelled or has
    finished, so what the runtime reports is where the sandbox stays. A local clock, so
    replicas' clocks need not agree.
    """

    def __init__(self, grace_s: float) -> None:
        self.grace_s = grace_s
        self._seen: dict[str, tuple[SandboxState, str | None, float]] = {}

    def due(self, orphans: list[SandboxRecord], now: float) -> list[SandboxRecord]:
        seen: dict[str, tuple[SandboxState, str | None, float]] = {}
        out = []
        for rec in orphans:
            state, owner, since = self._seen.get(rec.id, (rec.state, rec.replica_id, now))
            if (state, owner) != (rec.state, rec.replica_id):
                since = now  # another operation since: its own grace
            seen[rec.id] = (rec.state, rec.replica_id, since)
            if now - since >= self.grace_s:
                out.append(rec)
        # Rows no longer orphaned (settled, or taken up again) are forgotten.
        self._seen = seen
        return out

    def forget(self, sandbox_id: str) -> None:
        self._seen.pop(sandbox_id, None)
