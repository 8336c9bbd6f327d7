"""What the sandbox manager's parts share: the create request (`CreateSpec`), timeouts, and
`SandboxBase`: the manager's state, the per-sandbox lock, reading a row (and why it was lost)
and releasing a sandbox that is killed. Split from `sandboxes.py`; the transitions, the
queries, recovery and the reaper are mixins over it, put together by `SandboxManager`."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, NoReturn

from agentenv.contract.egress import Egress
from agentenv.contract.errors import (
    NotSupported,
    OperationFailed,
    OrchestratorError,
    SandboxLost,
    SandboxNotFound,
)
from agentenv.contract.runtime import (
    HostMemory,
    Runtime,
    SandboxSpec,
    TemplateSource,
    Unsupported,
)
from agentenv.control.metrics import Metrics
from agentenv.control.ownership import (
    DEFAULT_SWEEP_GRACE_S,
    DEFAULT_SWEEP_PERIOD_S,
    Orphans,
    Replicas,
)
from agentenv.control.store import SandboxRecord, SandboxState, Store
from agentenv.control.tenants import TeamLimits

log = logging.getLogger("agentenv.sandboxes")

# Lifecycle log lines of a sandbox that nobody deleted but is gone start with this.
LOST = "lost: "

DEFAULT_TIMEOUT_S = 300
# How long a pause with `requireHealthyGuest` waits for envd's `/health` before refusing.
ENVD_HEALTH_TIMEOUT_S = 5.0
MAX_TIMEOUT_S = 24 * 3600
# The longest a create may ask to wait for capacity (`capacityWait`, `X-Capacity-Wait`): a
# queue that holds callers longer is a stuck client's, not a burst's.
MAX_CAPACITY_WAIT_S = 600
# How often the reaper looks for expired sandboxes when nothing is due sooner.
_REAPER_TICK_S = 1.0
# How often paused sandboxes are checked against the retention limit (at most; a shorter
# retention is checked as often as it is long).
_RETENTION_CHECK_S = 30.0
# envd `/init` calls to a fork's children in flight at once.
_FORK_INIT_CONCURRENCY = 8


def _pause_mode(memory: bool) -> str:
    """E2B's `pauseMode` of a pause that kept (or dropped) the guest's memory."""
    return "full" if memory else "filesystem"


def egress_of(rec: SandboxRecord) -> Egress:
    """The egress policy a row asks for (the API validated its entries)."""
    return Egress.of(
        internet=rec.allow_internet,
        allow_out=rec.network.get("allowOut", []),
        deny_out=rec.network.get("denyOut", []),
        dns_servers=rec.network.get("dnsServers"),
    )


def raise_failure(exc: BaseException, what: str) -> NoReturn:
    """Raise what the API answers for `exc`, raised by the runtime while doing `what`
    ("sandbox x was not paused"): the contract's errors as they are, `Unsupported` as 501,
    any other error a 500 that says `what` and why (not "internal error"); cancellation
    passes."""
    if isinstance(exc, OrchestratorError) or not isinstance(exc, Exception):
        raise exc
    if isinstance(exc, Unsupported):
        raise NotSupported(str(exc)) from exc
    raise OperationFailed(f"{what}: {exc}") from exc


@dataclass
class CreateSpec:
    template: str
    timeout: int = DEFAULT_TIMEOUT_S
    auto_pause: bool = False
    # False: the auto-pause keeps only the disk (E2B's `autoPauseMemory: false`).
    auto_pause_memory: bool = True
    # None: the request did not say, so the server's default applies.
    auto_resume: bool | None = None
    secure: bool = True
    allow_internet: bool = True
    metadata: dict[str, str] = field(default_factory=dict)
    env_vars: dict[str, str] = field(default_factory=dict)
    network: dict[str, Any] = field(default_factory=dict)
    cpu: int | None = None
    memory_mb: int | None = None
    disk_mb: int | None = None
    # None: the server's default grace (`SandboxBase.timeout_grace_s`).
    grace_s: int | None = None
    keepalive_s: int = 0
    # None: the node's default wait for capacity (AGENTENV_CAPACITY_WAIT_S).
    capacity_wait_s: float | None = None


class SandboxBase:
    """The sandbox manager's state and the steps every transition uses."""

    def __init__(
        self,
        store: Store,
        runtime: Runtime,
        templates: TemplateSource,
        *,
        envd_version: str,
        metrics: Metrics | None = None,
        default_cpu: int = 1,
        default_memory_mb: int = 512,
        max_cpu: int = 8,
        min_memory_mb: int = 128,
        max_memory_mb: int = 16384,
        paused_retention_s: float = 0.0,
        retention_check_s: float | None = None,
        timeout_grace_s: int = 0,
        auto_resume: bool = False,
        shared: bool = False,
        replicas: Replicas | None = None,
        sweep_period_s: float = DEFAULT_SWEEP_PERIOD_S,
        sweep_grace_s: float = DEFAULT_SWEEP_GRACE_S,
    ) -> None:
        self.store = store
        self.runtime = runtime
        # Store and runtime shared with other control-plane replicas (a cluster): this one's
        # start and stop must not act on sandboxes other replicas are working on.
        self.shared = shared
        # With a shared store: this replica's registration among the others. Its id stamps
        # the rows it moves into a transitional state, and a sweep every `sweep_period_s`
        # settles rows whose replica is gone (`control.ownership`).
        self.replicas = replicas if shared else None
        self.replica_id = self.replicas.replica_id if self.replicas is not None else None
        self.sweep_period_s = sweep_period_s
        self._orphans = Orphans(sweep_grace_s)
        self._sweeper: asyncio.Task[None] | None = None
        self.templates = templates
        self.envd_version = envd_version
        self.metrics = metrics or Metrics()
        self.default_cpu = default_cpu
        self.default_memory_mb = default_memory_mb
        self.max_cpu = max_cpu
        self.min_memory_mb = min_memory_mb
        self.max_memory_mb = max_memory_mb
        # Paused sandboxes whose timeout passed longer ago than this are deleted (0: never).
        self.paused_retention_s = paused_retention_s
        self.retention_check_s = (
            min(_RETENTION_CHECK_S, paused_retention_s)
            if retention_check_s is None
            else retention_check_s
        )
        # Whether proxy traffic resumes a paused sandbox whose create request left it unset.
        self.auto_resume = auto_resume
        # The grace after the timeout of a sandbox whose create did not say (`grace_s`).
        self.timeout_grace_s = timeout_grace_s
        # Touches of sandboxes with a keepalive, not yet stored (`touch`, the reaper flushes).
        self._touched: dict[str, float] = {}
        self._keepalive_checked = 0.0
        # Whether any row may have a keepalive or a grace period (None: not looked yet): the
        # reaper scans the store for them only then.
        self._unattended_rows: bool | None = None
        # Requests the proxy has open to a sandbox now (set by the app that holds both): an
        # open stream is a client that is there.
        self.open_requests: Callable[[str], int] = lambda _sandbox_id: 0
        # Each team's own limits (concurrent sandboxes, create rate); none by default.
        own = self.replicas
        self.limits = TeamLimits(store, lease=(lambda: own.lease_id) if own is not None else None)
        self._retention_checked = 0.0
        self._locks: dict[str, asyncio.Lock] = {}
        # Sandboxes whose kill, under their lock, wrote the row gone: the lock's release
        # drops the lock without reading the row (`_locked`).
        self._ended: set[str] = set()
        self._reaper: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        # Called with a sandbox id once it stops being reachable (killed or paused), e.g. so
        # the proxy closes its connections to it.
        # Told of a sandbox that stops being reachable, and why when it lives on (a reset).
        self.on_release: list[Callable[[str, str | None], Awaitable[None]]] = []
        self._tasks: set[asyncio.Task[None]] = set()
        # The last `host_memory_all` (the metrics route refreshes it before each scrape).
        self.host_memory_seen: dict[str, HostMemory] = {}
        # The last `state_counts`: users' sandboxes by state and the live build sandboxes
        # (refreshed the same way: a Prometheus collector cannot await the store).
        self.state_counts_seen: dict[str, int] = {}
        self.builds_seen = 0

    @property
    def _stamp(self) -> dict[str, Any]:
        """The change that marks a row as this replica's operation (none on one server)."""
        return {} if self.replica_id is None else {"replica_id": self.replica_id}

    @contextlib.asynccontextmanager
    async def _locked(self, sandbox_id: str) -> AsyncIterator[None]:
        lock = self._locks.setdefault(sandbox_id, asyncio.Lock())
        async with lock:
            yield
        if not lock.locked() and sandbox_id in self._locks:
            if sandbox_id in self._ended:
                # Its kill under this lock wrote the row gone: no read to learn that (#23).
                self._ended.discard(sandbox_id)
                gone = True
            else:
                rec = await self.store.get(sandbox_id)
                gone = rec is None or rec.state is SandboxState.GONE
            # Looked at again after the read: another request may have taken the lock while
            # it was under way, and dropping a held lock would let a third one run beside it.
            if gone and not lock.locked() and self._locks.get(sandbox_id) is lock:
                self._locks.pop(sandbox_id, None)

    async def _lost_reason(self, sandbox_id: str) -> str | None:
        for line in reversed(await self.store.logs(sandbox_id)):
            if line.message.startswith(LOST):
                return line.message[len(LOST) :]
        return None

    async def get(self, sandbox_id: str) -> SandboxRecord:
        rec = await self.store.get(sandbox_id)
        if rec is None or rec.state in (SandboxState.GONE, SandboxState.KILLING):
            why = None if rec is None else await self._lost_reason(sandbox_id)
            if why is not None:
                raise SandboxLost(sandbox_id, why)
            raise SandboxNotFound(sandbox_id)
        self.touch(rec)
        return rec

    def touch(self, rec: SandboxRecord) -> None:
        """A client reached this sandbox (an API call on it, proxied traffic): its keepalive
        starts over. Kept in memory; the reaper stores it at its next keepalive check."""
        if rec.keepalive_s:
            self._touched[rec.id] = time.time()

    def _spec(self, rec: SandboxRecord) -> SandboxSpec:
        """Everything the node needs of this sandbox (`contract.runtime.SandboxSpec`): the
        node runs it under the row's id (its VM's name and its guest's hostname)."""
        return SandboxSpec(
            sandbox_id=rec.id,
            template=rec.template,
            cpu=rec.cpu,
            memory_mb=rec.memory_mb,
            disk_size_mb=rec.disk_mb,
            egress=egress_of(rec),
            env_vars=dict(rec.env_vars),
            envd_token=rec.envd_token,
            metadata=dict(rec.metadata),
        )

    async def _released(self, sandbox_id: str, why: str | None = None) -> None:
        for hook in self.on_release:
            try:
                await hook(sandbox_id, why)
            except Exception as exc:
                log.warning("sandbox %s release hook failed: %r", sandbox_id, exc)

    async def _kill_locked(self, rec: SandboxRecord, reason: str) -> None:
        sandbox_id = rec.id
        if not await self.store.transition(
            sandbox_id, rec.state, SandboxState.KILLING, **self._stamp
        ):
            raise SandboxNotFound(sandbox_id)
        if rec.envd_url is not None:
            try:
                await asyncio.shield(self.runtime.delete(sandbox_id))
            except Exception as exc:
                # The row still goes to gone: the node owns cleanup of what it allocated,
                # and a retry here could not do better than its own teardown did.
                log.error(
                    "sandbox %s delete failed: %r",
                    sandbox_id,
                    exc,
                    extra={"sandbox_id": sandbox_id},
                )
                await self.store.log(sandbox_id, f"delete failed: {exc!r}", "error")
        await self.store.transition(
            sandbox_id, SandboxState.KILLING, SandboxState.GONE, note=reason
        )
        self._ended.add(sandbox_id)
        await self._released(sandbox_id)
        log.info("sandbox %s gone (%s)", sandbox_id, reason, extra={"sandbox_id": sandbox_id})
