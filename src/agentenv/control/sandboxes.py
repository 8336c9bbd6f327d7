"""The per-sandbox state machine: create, connect, pause, resume, timeouts, kill.

creating → running → pausing → paused → resuming → running … → killing → gone

Every transition is a compare-and-set on the stored state, taken while holding that sandbox's
lock, so concurrent requests for one sandbox run one after another and a request that loses the
race sees the state the winner left. A transition that fails part-way is rolled back (pause,
resume) or torn down to ``gone`` (create), never left in a transitional state.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Any

from agentenv.contract.errors import (
    BadRequest,
    Conflict,
    CreateFailed,
    InsufficientStorage,
    NotSupported,
    SandboxLost,
    SandboxNotFound,
    TemplateNotFound,
    Unavailable,
)
from agentenv.contract.ids import new_sandbox_id
from agentenv.contract.runtime import (
    HostMemory,
    Lost,
    Placement,
    Runtime,
    SandboxSpec,
    SnapshotInfo,
    TagUnavailable,
    TemplateSource,
    TemplateUnavailable,
    Unsupported,
)
from agentenv.control.metrics import Metrics
from agentenv.control.ownership import (
    DEFAULT_SWEEP_GRACE_S,
    DEFAULT_SWEEP_PERIOD_S,
    RESTART,
    TRANSITIONAL,
    Orphans,
    Replicas,
    Settling,
    after_replica,
)
from agentenv.control.store import (
    BUILD_METADATA,
    DEFAULT_TEAM,
    LIVE_STATES,
    SandboxRecord,
    SandboxState,
    Store,
)
from agentenv.control.tenants import TeamLimits
from agentenv.faults import crash_point
from agentenv.network.egress import Egress

log = logging.getLogger("agentenv.sandboxes")

# Lifecycle log lines of a sandbox that nobody deleted but is gone start with this.
LOST = "lost: "

DEFAULT_TIMEOUT_S = 300
# How long a pause with `requireHealthyGuest` waits for envd's `/health` before refusing.
ENVD_HEALTH_TIMEOUT_S = 5.0
MAX_TIMEOUT_S = 24 * 3600
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


class SandboxManager:
    """Owns the lifecycle of every sandbox on this server."""

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
        # Each team's own limits (concurrent sandboxes, create rate); none by default.
        own = self.replicas
        self.limits = TeamLimits(store, lease=(lambda: own.lease_id) if own is not None else None)
        self._retention_checked = 0.0
        self._locks: dict[str, asyncio.Lock] = {}
        self._reaper: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        # Called with a sandbox id once it stops being reachable (killed or paused), e.g. so
        # the proxy closes its connections to it.
        self.on_release: list[Callable[[str], Awaitable[None]]] = []
        self._tasks: set[asyncio.Task[None]] = set()
        # The last `host_memory_all` (the metrics route refreshes it before each scrape).
        self.host_memory_seen: dict[str, HostMemory] = {}
        # The last `state_counts`: users' sandboxes by state and the live build sandboxes
        # (refreshed the same way: a Prometheus collector cannot await the store).
        self.state_counts_seen: dict[str, int] = {}
        self.builds_seen = 0

    # -- lifecycle of the manager ----------------------------------------------------------

    async def start(self) -> None:
        if self.replicas is not None:
            # Registered before any row is stamped with the id: a stamp always names a
            # replica that was alive when it was written.
            await self.replicas.start()
        await self.runtime.start()
        self.runtime.watch_lost(self._runtime_lost)
        if not self.shared:
            await self._reconcile()
        elif self.replicas is not None:
            # A replica that starts beside others cannot tell their operations in flight from
            # a crashed one's by looking: the stamps and the replicas' leases tell.
            self._sweeper = asyncio.create_task(self._sweep_forever(), name="orphan-sweeper")
        self._reaper = asyncio.create_task(self._reap_forever(), name="sandbox-reaper")

    @property
    def _stamp(self) -> dict[str, Any]:
        """The change that marks a row as this replica's operation (none on one server)."""
        return {} if self.replica_id is None else {"replica_id": self.replica_id}

    async def close(self) -> None:
        """Stop the reaper and tear down every running sandbox. Paused ones stay: the runtime
        keeps them on disk and the next server resumes them."""
        try:
            await self._close()
        finally:
            await self.limits.close()
            if self.replicas is not None:
                # Revoked last: what this replica leaves half-done is the others' at once.
                await self.replicas.close()

    async def _close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            await asyncio.gather(self._sweeper, return_exceptions=True)
            self._sweeper = None
        if self._reaper is not None:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
            self._reaper = None
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        # One server's sandboxes end with it; a cluster's live on its nodes, past any replica.
        for rec in (
            [] if self.shared else await self.store.select(LIVE_STATES - {SandboxState.PAUSED})
        ):
            with contextlib.suppress(SandboxNotFound):
                await self.kill(rec.id, reason="server shutdown")
        await self.runtime.close()

    async def _reconcile(self) -> None:
        """Match the rows a previous server left with what the runtime re-adopted.

        Running and paused sandboxes carry on (ids, tokens, timeouts, metadata kept); rows
        in a transitional state are settled (`_settle`). Sandboxes the runtime holds that no
        row names (a fork cut short) are deleted."""
        named: set[str] = set()
        for rec in await self.store.select(LIVE_STATES):
            rid = await self._settle(rec, RESTART)
            if rid is not None:
                named.add(rid)
        for rid in await self.runtime.sandbox_ids():
            if rid not in named:
                log.warning("runtime sandbox %s belongs to no sandbox; deleting it", rid)
                with contextlib.suppress(Exception):
                    await self.runtime.delete(rid)

    async def _settle(self, rec: SandboxRecord, how: Settling) -> str | None:
        """Bring a row whose operation nobody runs any more in line with the runtime.

        A pause or resume cut short ends in the state the runtime finds the sandbox in
        (rolled forward or back there); a create or kill cut short is finished as a kill
        (the caller never got the sandbox, or asked for it to go). A row whose sandbox the
        runtime does not hold is lost, with the reason in its log. Every write is a
        compare-and-set from the state read: if another writer moved the row meanwhile,
        nothing more is done. Returns the sandbox id when the row still names a sandbox of the
        runtime (None once gone)."""
        rid = rec.id
        found = await self.runtime.find(rid)
        was = rec.state.value
        now = time.time()
        if found is None or rec.state in (SandboxState.CREATING, SandboxState.KILLING):
            state = rec.state
            if self.shared and state is SandboxState.CREATING and found is not None:
                # Killing while its VM goes: a replica that dies here leaves a kill (stamped
                # with its id) for the next sweep, not a create.
                if not await self.store.transition(rec.id, state, SandboxState.KILLING):
                    return None
                state = SandboxState.KILLING
            if found is not None:
                with contextlib.suppress(Exception):
                    await self.runtime.delete(rid)
            why = None
            if state not in (SandboxState.CREATING, SandboxState.KILLING):
                # Asked before the row goes: a node that cannot answer now raises here, and
                # the row stays for another try instead of being lost on a hiccup.
                why = await self.runtime.lost_reason(rid) or how.nothing
            if not await self.store.transition(rec.id, state, SandboxState.GONE):
                return None
            if rec.state is SandboxState.KILLING:
                await self.store.log(rec.id, how.killed)
            elif rec.state is SandboxState.CREATING:
                await self.store.log(rec.id, how.cut_short, "warn")
            else:
                await self.store.log(rec.id, f"{LOST}{why} (was {was})", "error")
            await self._released(rec.id)
            return None
        if found.state == "running" and found.placement is not None:
            # A resume cut short after the guest ran: the timeout it would have started
            # (its request's value is gone with the request).
            end_at = rec.end_at
            if rec.state in (SandboxState.RESUMING, SandboxState.PAUSED):
                end_at = now + DEFAULT_TIMEOUT_S
            if not await self.store.transition(
                rec.id,
                rec.state,
                SandboxState.RUNNING,
                address=found.placement.address,
                node_id=found.placement.node_id,
                envd_url=found.placement.envd_url,
                end_at=end_at,
                pause_mode=None,
            ):
                return rid
            await self.store.log(rec.id, how.running.format(was=was))
            if rec.state is SandboxState.RESUMING:
                # The cut may have come before the control plane's `/init`: a guest
                # booted from its disk would run with an envd that has no token yet.
                try:
                    await self.runtime.init_guest(self._spec(rec))
                except Exception as exc:
                    await self.store.log(rec.id, how.init_failed.format(exc=exc), "warn")
        elif found.state == "paused":
            if not await self.store.transition(
                rec.id,
                rec.state,
                SandboxState.PAUSED,
                address=None,
                end_at=min(rec.end_at, now),
                pause_mode=_pause_mode(found.memory),
            ):
                return rid
            if rec.state is not SandboxState.PAUSED:
                await self.store.log(rec.id, how.paused.format(was=was))
                if self.shared:
                    # Other replicas' proxies may hold connections to it: a paused guest
                    # answers nothing, so they are ended here.
                    await self._released(rec.id)
        return rid

    # -- orphaned operations (replicas sharing a store) ------------------------------------

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(self.sweep_period_s)
            try:
                await self.sweep_orphans()
            except Exception as exc:
                # etcd or a node out of reach: the next sweep tries again.
                log.warning("orphan sweep failed: %r", exc)

    async def sweep_orphans(self) -> list[str]:
        """Settle the rows left in a transitional state by replicas that are gone (seen so
        for the grace period); returns the ids this replica settled."""
        if self.replicas is None:
            return []
        # The rows first, then who is alive: a stamp in a row read here was written by a
        # replica registered before it, so one alive now is in the set read after.
        rows = await self.store.select(TRANSITIONAL)
        live = await self.replicas.live() if rows else set()
        if rows and self.replica_id not in live:
            # Our own lease is gone (etcd out of reach, or this process stalled): we are the
            # one that may look dead, and must not judge the others until registered again.
            log.warning("replica %s: not registered; orphan sweep skipped", self.replica_id)
            return []
        orphans = [r for r in rows if r.replica_id not in live]
        settled: list[str] = []
        for rec in self._orphans.due(orphans, time.monotonic()):
            try:
                if await self._take_over(rec):
                    settled.append(rec.id)
            except Exception as exc:
                log.warning("sandbox %s: taking over its %s failed: %r", rec.id, rec.state, exc)
            self._orphans.forget(rec.id)
        return settled

    async def _take_over(self, rec: SandboxRecord) -> bool:
        assert self.replica_id is not None
        async with self._locked(rec.id):
            # Of replicas sweeping at once, one stamps the row; the others find the stamp
            # changed (or the row moved on) and leave it.
            if not await self.store.claim(rec.id, rec.state, rec.replica_id, self.replica_id):
                return False
            owner = rec.replica_id or "none"
            log.warning(
                "sandbox %s: %s left by replica %s, which is gone; settling it",
                rec.id,
                rec.state.value,
                owner,
                extra={"sandbox_id": rec.id},
            )
            await self.store.log(
                rec.id, f"replica {self.replica_id} settles the {rec.state.value} of {owner}"
            )
            current = await self.store.get(rec.id)
            if current is None or current.state is not rec.state:
                return False
            try:
                await self._settle(current, after_replica(rec.replica_id))
            except BaseException:
                # Stamped with a live replica, the row would never be swept again: the old
                # stamp goes back, so a later sweep (this one's or another's) tries again.
                with contextlib.suppress(Exception):
                    await self.store.update(rec.id, replica_id=rec.replica_id)
                raise
        return True

    def _runtime_lost(self, sandbox_id: str, why: str) -> None:
        """The runtime says a running sandbox's VM ended on its own."""
        task = asyncio.create_task(self._lose(sandbox_id, why), name=f"lost-{sandbox_id}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _lose(self, sandbox_id: str, why: str) -> None:
        rec = await self.store.get(sandbox_id)
        if rec is None or rec.state is SandboxState.GONE:
            with contextlib.suppress(Exception):
                await self.runtime.delete(sandbox_id)
            return
        async with self._locked(sandbox_id):
            rec = await self.store.get(sandbox_id)
            # An operation holding the lock may have replaced the VM meanwhile (a resume).
            if (
                rec is None
                or rec.state is not SandboxState.RUNNING
                or await self.runtime.is_alive(sandbox_id)
            ):
                return
            self.metrics.sandboxes_lost.inc()
            # Logged first: from here on every request for it is told why it is gone.
            await self.store.log(rec.id, f"{LOST}{why}", "error")
            await self._kill_locked(rec, "its resources were released")

    async def _lost_reason(self, sandbox_id: str) -> str | None:
        for line in reversed(await self.store.logs(sandbox_id)):
            if line.message.startswith(LOST):
                return line.message[len(LOST) :]
        return None

    @contextlib.asynccontextmanager
    async def _locked(self, sandbox_id: str) -> AsyncIterator[None]:
        lock = self._locks.setdefault(sandbox_id, asyncio.Lock())
        async with lock:
            yield
        if not lock.locked() and sandbox_id in self._locks:
            rec = await self.store.get(sandbox_id)
            # Looked at again after the read: another request may have taken the lock while
            # it was under way, and dropping a held lock would let a third one run beside it.
            gone = rec is None or rec.state is SandboxState.GONE
            if gone and not lock.locked() and self._locks.get(sandbox_id) is lock:
                self._locks.pop(sandbox_id, None)

    # -- queries ---------------------------------------------------------------------------

    async def get(self, sandbox_id: str) -> SandboxRecord:
        rec = await self.store.get(sandbox_id)
        if rec is None or rec.state in (SandboxState.GONE, SandboxState.KILLING):
            why = None if rec is None else await self._lost_reason(sandbox_id)
            if why is not None:
                raise SandboxLost(sandbox_id, why)
            raise SandboxNotFound(sandbox_id)
        return rec

    async def guest_metrics(self, rec: SandboxRecord) -> dict[str, Any] | None:
        """envd's current `/metrics` sample, or None when the guest cannot say."""
        if rec.state is not SandboxState.RUNNING:
            return None
        return await self.runtime.guest_metrics(rec.id, rec.envd_token)

    async def _envd_unhealthy(self, rec: SandboxRecord) -> str | None:
        """Why the sandbox's envd does not answer `/health` now, or None when it does."""
        return await self.runtime.guest_health(rec.id)

    def note_activity(self, rec: SandboxRecord) -> None:
        """The proxy passed traffic to this sandbox (it is not idle)."""
        self.runtime.note_activity(rec.id)

    async def host_memory(self, rec: SandboxRecord) -> HostMemory | None:
        if rec.state is not SandboxState.RUNNING:
            return None
        return await self.runtime.host_memory(rec.id)

    async def host_memories(self, recs: list[SandboxRecord]) -> list[HostMemory | None]:
        """`host_memory` of each, asked concurrently (a list of many sandboxes on nodes)."""
        return list(await asyncio.gather(*(self.host_memory(r) for r in recs)))

    async def host_memory_all(self) -> dict[str, HostMemory]:
        """Host memory of every running sandbox, by sandbox id; also kept as
        `host_memory_seen` for the Prometheus collector, which cannot await."""
        recs = await self.store.select([SandboxState.RUNNING])
        mems = await self.host_memories(recs)
        out = {r.id: m for r, m in zip(recs, mems, strict=True) if m is not None}
        self.host_memory_seen = out
        return out

    async def state_counts(self) -> tuple[dict[str, int], int]:
        """Users' sandboxes by state and the build sandboxes holding a VM, from the store;
        also kept as `state_counts_seen` / `builds_seen` for the Prometheus collector."""
        counts = await self.store.count_by_state()
        builds = await self.store.count_builds()
        self.state_counts_seen, self.builds_seen = counts, builds
        return counts, builds

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

    # -- transitions -----------------------------------------------------------------------

    async def team_of_key(self, api_key_id: str | None) -> str:
        """The team a key belongs to (what it creates is that team's)."""
        key = await self.store.key(api_key_id) if api_key_id is not None else None
        return key.team_id if key is not None else DEFAULT_TEAM

    async def create(
        self, spec: CreateSpec, api_key_id: str | None = None, team_id: str | None = None
    ) -> SandboxRecord:
        """A new sandbox of `team_id` (default: the team of `api_key_id`). The team's limits
        apply (429), except to template build sandboxes, which are the server's."""
        team = team_id or await self.team_of_key(api_key_id)
        try:
            tpl = await self.templates.get(spec.template)
        except TemplateUnavailable as exc:
            tag = str(exc) if isinstance(exc, TagUnavailable) else None
            raise TemplateNotFound(spec.template, tag) from exc
        cpu = spec.cpu or tpl.cpu or self.default_cpu
        memory = spec.memory_mb or tpl.memory_mb or self.default_memory_mb
        disk = spec.disk_mb or tpl.size_mb
        if not 1 <= cpu <= self.max_cpu:
            raise BadRequest(f"cpuCount must be between 1 and {self.max_cpu}")
        if not self.min_memory_mb <= memory <= self.max_memory_mb:
            raise BadRequest(
                f"memoryMB must be between {self.min_memory_mb} and {self.max_memory_mb}"
            )
        if disk < tpl.size_mb:
            raise BadRequest(f"diskSizeMB must be at least the template size ({tpl.size_mb})")
        now = time.time()
        rec = SandboxRecord(
            id=new_sandbox_id(),
            template=tpl.template_id or spec.template,
            alias=tpl.name,
            state=SandboxState.CREATING,
            started_at=now,
            end_at=now + spec.timeout,
            cpu=cpu,
            memory_mb=memory,
            disk_mb=disk,
            envd_version=self.envd_version,
            metadata=dict(spec.metadata),
            env_vars=dict(spec.env_vars),
            envd_token=secrets.token_urlsafe(24) if spec.secure else None,
            traffic_token=(
                secrets.token_urlsafe(24)
                if not spec.network.get("allowPublicTraffic", True)
                else None
            ),
            auto_pause=spec.auto_pause,
            auto_pause_memory=spec.auto_pause_memory,
            auto_resume=self.auto_resume if spec.auto_resume is None else spec.auto_resume,
            allow_internet=spec.allow_internet,
            network=dict(spec.network),
            api_key_id=api_key_id,
            team_id=team,
            replica_id=self.replica_id,
        )
        started = time.monotonic()
        async with self._locked(rec.id):
            if BUILD_METADATA in rec.metadata:
                await self.store.insert(rec)
            else:
                # The place is held from the check until the row that takes it is stored.
                async with self.limits.reserve(team):
                    await self.store.insert(rec)
            await self.store.log(rec.id, f"creating from template {rec.template!r}")
            log.info(
                "sandbox %s creating template=%s",
                rec.id,
                rec.template,
                extra={"sandbox_id": rec.id, "template": rec.template},
            )
            placement: Placement | None = None
            try:
                placement = await self.runtime.create(
                    replace(self._spec(rec), template=tpl.ref or rec.template)
                )
                # The sandbox's life (and its timeout) starts when it is usable, not when the
                # request arrived: a slow boot must not eat into the caller's timeout.
                ready_at = time.time()
                if not await self.store.transition(
                    rec.id,
                    SandboxState.CREATING,
                    SandboxState.RUNNING,
                    address=placement.address,
                    node_id=placement.node_id,
                    envd_url=placement.envd_url,
                    started_at=ready_at,
                    end_at=ready_at + spec.timeout,
                ):
                    raise CreateFailed(f"sandbox {rec.id} left 'creating' unexpectedly")
            except BaseException as exc:
                if isinstance(exc, Unavailable | InsufficientStorage):
                    status = "503" if isinstance(exc, Unavailable) else "507"
                    self.metrics.create_refusals.labels(status).inc()
                else:
                    self.metrics.create_failures.inc()
                await self._teardown_failed_create(rec, placement, exc)
                if isinstance(exc, TemplateUnavailable):
                    raise TemplateNotFound(spec.template) from exc
                # A node's refusal (503, nothing was made) and a full disk (507) keep theirs.
                passed = (CreateFailed, Unavailable, InsufficientStorage)
                if isinstance(exc, Exception) and not isinstance(exc, passed):
                    raise CreateFailed(f"sandbox creation failed: {exc}") from exc
                raise
        self.metrics.create_seconds.observe(time.monotonic() - started)
        await self.store.log(rec.id, "running")
        log.info(
            "sandbox %s running address=%s",
            rec.id,
            placement.address,
            extra={"sandbox_id": rec.id, "address": placement.address},
        )
        self._wake.set()
        return await self.get(rec.id)

    async def _teardown_failed_create(
        self, rec: SandboxRecord, placement: Placement | None, exc: BaseException
    ) -> None:
        await self.store.transition(
            rec.id, SandboxState.CREATING, SandboxState.KILLING, **self._stamp
        )
        await self.store.log(rec.id, f"create failed: {exc!r}", "error")
        log.warning("sandbox %s create failed: %r", rec.id, exc, extra={"sandbox_id": rec.id})
        if placement is not None:
            try:
                await asyncio.shield(self.runtime.delete(rec.id))
            except Exception as del_exc:
                log.error("sandbox %s teardown after failed create: %r", rec.id, del_exc)
        await self.store.transition(rec.id, SandboxState.KILLING, SandboxState.GONE)

    async def _released(self, sandbox_id: str) -> None:
        for hook in self.on_release:
            try:
                await hook(sandbox_id)
            except Exception as exc:
                log.warning("sandbox %s release hook failed: %r", sandbox_id, exc)

    async def snapshot(
        self, sandbox_id: str, name: str | None, *, memory: bool = True
    ) -> SnapshotInfo:
        """A persistent snapshot of a running sandbox; it keeps running. `memory=False`: its
        disk only (E2B's filesystem-only snapshot), whose creates boot from that disk."""
        async with self._locked(sandbox_id):
            rec = await self.get(sandbox_id)
            if rec.state is not SandboxState.RUNNING:
                raise Conflict(f"sandbox {sandbox_id} is {rec.state.value}, not running")
            try:
                rid = rec.id
                if memory:
                    info = await self.runtime.snapshot(rid, name, rec.envd_token)
                else:
                    info = await self.runtime.snapshot(rid, name, rec.envd_token, memory=False)
            except Unsupported as exc:
                raise NotSupported(str(exc)) from exc
            # The guest may have moved to another QEMU (same slot, same address).
            await self.store.log(sandbox_id, f"snapshot {info.snapshot_id} {info.names}")
        return info

    async def fork(
        self, sandbox_id: str, count: int, lifetime_s: int | None, api_key_id: str | None = None
    ) -> list[SandboxRecord]:
        """`count` new running sandboxes from one capture of a running one; they are the
        source's team's, within its limits."""
        async with self._locked(sandbox_id):
            src = await self.get(sandbox_id)
            if src.state is not SandboxState.RUNNING:
                raise Conflict(f"sandbox {sandbox_id} is {src.state.value}, not running")
            async with self.limits.reserve(src.team_id, count):
                # The children's rows come first (as creating): a crash during the fork
                # finds them and finishes them as kills.
                recs = await self._fork_rows(src, count, lifetime_s, api_key_id)
                try:
                    placements = await self.runtime.fork(
                        src.id,
                        [replace(self._spec(r), env_vars=dict(src.env_vars)) for r in recs],
                        src.envd_token,
                    )
                except BaseException as exc:
                    for rec in recs:
                        await self._teardown_failed_create(rec, None, exc)
                    if isinstance(exc, Unsupported):
                        raise NotSupported(str(exc)) from exc
                    raise
                await self.store.log(sandbox_id, f"forked {len(placements)} sandbox(es)")
        return await self._start_forks(recs, placements)

    async def _fork_rows(
        self,
        src: SandboxRecord,
        count: int,
        lifetime_s: int | None,
        api_key_id: str | None,
    ) -> list[SandboxRecord]:
        sandbox_id = src.id
        seconds = lifetime_s if lifetime_s is not None else DEFAULT_TIMEOUT_S
        recs: list[SandboxRecord] = []
        for _ in range(count):
            now = time.time()
            rec = SandboxRecord(
                id=new_sandbox_id(),
                template=src.template,
                alias=src.alias,
                state=SandboxState.CREATING,
                started_at=now,
                end_at=now + seconds,
                cpu=src.cpu,
                memory_mb=src.memory_mb,
                disk_mb=src.disk_mb,
                envd_version=self.envd_version,
                metadata=dict(src.metadata),
                env_vars=dict(src.env_vars),
                envd_token=secrets.token_urlsafe(24) if src.envd_token else None,
                traffic_token=secrets.token_urlsafe(24) if src.traffic_token else None,
                auto_pause=src.auto_pause,
                auto_resume=src.auto_resume,
                auto_pause_memory=src.auto_pause_memory,
                allow_internet=src.allow_internet,
                network=dict(src.network),
                api_key_id=api_key_id,
                team_id=src.team_id,
                replica_id=self.replica_id,
            )
            await self.store.insert(rec)
            await self.store.log(rec.id, f"forked from {sandbox_id}")
            recs.append(rec)
        return recs

    async def _start_forks(
        self, recs: list[SandboxRecord], placements: list[Placement]
    ) -> list[SandboxRecord]:
        # Each child's envd had its `/init` (its own token) on the node.
        children: list[SandboxRecord] = []
        for rec, placement in zip(recs, placements, strict=True):
            await self.store.transition(
                rec.id,
                SandboxState.CREATING,
                SandboxState.RUNNING,
                address=placement.address,
                node_id=placement.node_id,
                envd_url=placement.envd_url,
            )
            children.append(await self.get(rec.id))
        self._wake.set()
        return children

    async def snapshots(self) -> list[SnapshotInfo]:
        return await self.runtime.snapshots()

    async def kill(self, sandbox_id: str, *, reason: str = "killed") -> None:
        async with self._locked(sandbox_id):
            rec = await self.store.get(sandbox_id)
            if rec is None or rec.state is SandboxState.GONE:
                raise SandboxNotFound(sandbox_id)
            await self._kill_locked(rec, reason)

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
        await self.store.transition(sandbox_id, SandboxState.KILLING, SandboxState.GONE)
        await self._released(sandbox_id)
        await self.store.log(sandbox_id, reason)
        log.info("sandbox %s gone (%s)", sandbox_id, reason, extra={"sandbox_id": sandbox_id})

    async def update_network(
        self,
        sandbox_id: str,
        allow_internet: bool,
        allow_out: list[str],
        deny_out: list[str],
        dns_servers: list[str] | None = None,
    ) -> None:
        """Replace a running or paused sandbox's egress policy (omitted parts are cleared,
        as E2B does); it holds at once while the sandbox runs."""
        async with self._locked(sandbox_id):
            rec = await self.get(sandbox_id)
            if rec.state not in (SandboxState.RUNNING, SandboxState.PAUSED):
                raise Conflict(f"sandbox {sandbox_id} is {rec.state.value}")
            egress_keys = ("allowOut", "denyOut", "dnsServers")
            network = {k: v for k, v in rec.network.items() if k not in egress_keys}
            if allow_out:
                network["allowOut"] = allow_out
            if deny_out:
                network["denyOut"] = deny_out
            if dns_servers is not None:
                network["dnsServers"] = dns_servers
            updated = replace(rec, allow_internet=allow_internet, network=network)
            await self.runtime.update_egress(rec.id, egress_of(updated))
            await self.store.update(sandbox_id, allow_internet=allow_internet, network=network)
            await self.store.log(sandbox_id, f"network policy set: {egress_of(updated).to_json()}")

    async def set_timeout(self, sandbox_id: str, seconds: int) -> None:
        async with self._locked(sandbox_id):
            rec = await self.get(sandbox_id)
            if rec.state not in (SandboxState.RUNNING, SandboxState.PAUSED):
                raise Conflict(f"sandbox {sandbox_id} is {rec.state.value}")
            await self.store.update(sandbox_id, end_at=time.time() + seconds)
            await self.store.log(sandbox_id, f"timeout set to {seconds}s")
        self._wake.set()

    async def refresh(self, sandbox_id: str, duration: int) -> None:
        """Extend the sandbox's life to at least ``duration`` seconds from now."""
        async with self._locked(sandbox_id):
            rec = await self.get(sandbox_id)
            if rec.state is not SandboxState.RUNNING:
                raise Conflict(f"sandbox {sandbox_id} is {rec.state.value}")
            await self.store.update(sandbox_id, end_at=max(rec.end_at, time.time() + duration))

    async def connect(
        self, sandbox_id: str, seconds: int | None, *, memory: bool | None = None
    ) -> tuple[SandboxRecord, bool]:
        """Make sure the sandbox runs; returns it and whether it had to be resumed.

        ``memory=False`` resumes a paused sandbox by a cold boot from its disk, its saved
        memory dropped, and means nothing for a running one (E2B's connect)."""
        async with self._locked(sandbox_id):
            rec = await self.get(sandbox_id)
            if rec.state is SandboxState.RUNNING:
                if seconds is not None:
                    # Connecting only ever extends a running sandbox's life.
                    end_at = max(rec.end_at, time.time() + seconds)
                    await self.store.update(sandbox_id, end_at=end_at)
                return await self.get(sandbox_id), False
            if rec.state is SandboxState.PAUSED:
                await self._resume_locked(rec, seconds, memory=memory is not False)
                return await self.get(sandbox_id), True
            raise Conflict(f"sandbox {sandbox_id} is {rec.state.value}")

    async def resume(
        self,
        sandbox_id: str,
        seconds: int | None,
        *,
        auto_pause: bool | None = None,
        memory: bool | None = None,
    ) -> SandboxRecord:
        """Resume a paused sandbox; ``auto_pause`` replaces its auto-pause setting."""
        async with self._locked(sandbox_id):
            rec = await self.get(sandbox_id)
            if rec.state is not SandboxState.PAUSED:
                raise Conflict(f"sandbox {sandbox_id} is {rec.state.value}, not paused")
            await self._resume_locked(rec, seconds, memory=memory is not False)
            if auto_pause is not None:
                await self.store.update(sandbox_id, auto_pause=auto_pause)
        return await self.get(sandbox_id)

    async def _resume_locked(
        self, rec: SandboxRecord, seconds: int | None, *, memory: bool = True
    ) -> None:
        if BUILD_METADATA in rec.metadata:
            moved = await self.store.transition(
                rec.id, SandboxState.PAUSED, SandboxState.RESUMING, **self._stamp
            )
        else:
            # A resumed sandbox takes a place again: held from the check until it has.
            async with self.limits.reserve(rec.team_id, create=False):
                moved = await self.store.transition(
                    rec.id, SandboxState.PAUSED, SandboxState.RESUMING, **self._stamp
                )
        if not moved:
            raise Conflict(f"sandbox {rec.id} changed state during resume")
        started = time.monotonic()
        rid = rec.id
        try:
            # The node re-inits envd (clock, entropy; a guest booted from its disk gets the
            # full `/init` of a create) and pauses it again if that fails.
            spec = self._spec(rec)
            placement = await (
                self.runtime.resume(spec) if memory else self.runtime.resume(spec, memory=False)
            )
        except BaseException as exc:
            if isinstance(exc, Lost):
                # The guest ran again and failed: nothing paused is left to go back to.
                await self.store.transition(rec.id, SandboxState.RESUMING, SandboxState.GONE)
                await self.store.log(rec.id, f"{LOST}{exc}", "error")
                await self._released(rec.id)
                raise SandboxLost(rec.id, str(exc)) from exc
            # A resume without memory may have dropped it before it failed.
            found = await self.runtime.find(rid)
            mode = rec.pause_mode
            if found is not None and found.state == "paused":
                mode = _pause_mode(found.memory)
            await self.store.transition(
                rec.id, SandboxState.RESUMING, SandboxState.PAUSED, pause_mode=mode
            )
            if isinstance(exc, Unsupported):
                raise NotSupported(str(exc)) from exc
            raise
        await self.store.transition(
            rec.id,
            SandboxState.RESUMING,
            SandboxState.RUNNING,
            address=placement.address,
            node_id=placement.node_id,
            envd_url=placement.envd_url,
            end_at=time.time() + (seconds if seconds is not None else DEFAULT_TIMEOUT_S),
            pause_mode=None,
        )
        self.metrics.resume_seconds.observe(time.monotonic() - started)
        await self.store.log(
            rec.id, "resumed by a boot from its disk" if placement.booted else "resumed"
        )
        self._wake.set()

    async def pause(
        self,
        sandbox_id: str,
        *,
        require_healthy_guest: bool = False,
        memory: bool = True,
        strict: bool = True,
    ) -> None:
        """Pause a running sandbox. ``require_healthy_guest``: refuse (503, it keeps running)
        while its envd does not answer, instead of saving a guest that may be stuck.
        ``memory=False``: keep only its disk (E2B's filesystem-only pause; the resume boots
        it), which always needs envd to flush the disk; ``strict=False`` (an auto-pause)
        pauses anyway, with what the disk holds, rather than refuse."""
        async with self._locked(sandbox_id):
            rec = await self.get(sandbox_id)
            if rec.state is SandboxState.PAUSED:
                raise Conflict(f"sandbox {sandbox_id} is already paused")
            check = require_healthy_guest or (not memory and strict)
            if check and rec.state is SandboxState.RUNNING:
                why = await self._envd_unhealthy(rec)
                if why is not None:
                    raise Unavailable(
                        f"sandbox {sandbox_id} was not paused: its guest agent (envd) does not "
                        f"answer ({why}); it keeps running"
                    )
            if not await self.store.transition(
                sandbox_id, SandboxState.RUNNING, SandboxState.PAUSING, **self._stamp
            ):
                raise Conflict(f"sandbox {sandbox_id} is {rec.state.value}")
            # Tests of a replica dying mid-pause: the row says pausing, the node was not asked.
            crash_point("control:pausing")
            try:
                rid = rec.id
                if memory:
                    await self.runtime.pause(rid)
                else:
                    await self.runtime.pause(
                        rid, memory=False, envd_token=rec.envd_token, strict=strict
                    )
            except BaseException as exc:
                await self.store.transition(sandbox_id, SandboxState.PAUSING, SandboxState.RUNNING)
                if isinstance(exc, Unsupported):
                    raise NotSupported(str(exc)) from exc
                raise
            # A paused sandbox's timeout stops (a resume starts a new one), and its retention
            # counts from now, not from a deadline it never reached.
            await self.store.transition(
                sandbox_id,
                SandboxState.PAUSING,
                SandboxState.PAUSED,
                address=None,
                end_at=min(rec.end_at, time.time()),
                pause_mode=_pause_mode(memory),
            )
            await self._released(sandbox_id)
            await self.store.log(sandbox_id, "paused" if memory else "paused (filesystem only)")

    # -- timeouts --------------------------------------------------------------------------

    async def _reap_forever(self) -> None:
        while True:
            deadline = await self.store.next_deadline()
            wait = _REAPER_TICK_S
            if deadline is not None:
                wait = min(wait, max(0.0, deadline - time.time()))
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout=wait)
            await self.reap_expired()

    async def reap_expired(self) -> None:
        await self._reap_paused()
        for rec in await self.store.expired(time.time()):
            try:
                await self._expire(rec.id)
            except Exception as exc:
                log.error("sandbox %s expiry failed: %r", rec.id, exc)

    async def _reap_paused(self) -> None:
        """Paused sandboxes past their retention go, with everything only they held."""
        now = time.time()
        if self.paused_retention_s <= 0 or now - self._retention_checked < self.retention_check_s:
            return
        self._retention_checked = now
        for rec in await self.store.select([SandboxState.PAUSED]):
            if self._retention_over(rec, now):
                try:
                    await self._collect_paused(rec.id)
                except Exception as exc:
                    # One sandbox that cannot be deleted must not stop the reaper.
                    log.error("sandbox %s retention delete failed: %r", rec.id, exc)

    def _retention_over(self, rec: SandboxRecord, now: float) -> bool:
        return rec.end_at + self.paused_retention_s <= now

    async def _collect_paused(self, sandbox_id: str) -> None:
        async with self._locked(sandbox_id):
            rec = await self.store.get(sandbox_id)
            # The rows were read before earlier deletions awaited: a connect may have resumed
            # this one, or a new timeout moved its deadline, in the meantime.
            if (
                rec is None
                or rec.state is not SandboxState.PAUSED
                or not self._retention_over(rec, time.time())
            ):
                return
            await self._kill_locked(rec, "paused longer than the retention limit")

    async def _expire(self, sandbox_id: str) -> None:
        async with self._locked(sandbox_id):
            rec = await self.store.get(sandbox_id)
            # The deadline may have moved while we waited for the lock.
            if rec is None or rec.state is not SandboxState.RUNNING or rec.end_at > time.time():
                return
            auto_pause, memory = rec.auto_pause, rec.auto_pause_memory
        if auto_pause:
            try:
                await self.pause(sandbox_id, memory=memory, strict=False)
                await self.store.log(sandbox_id, "paused on timeout")
                return
            except NotSupported as exc:
                await self.store.log(sandbox_id, f"auto-pause unavailable ({exc}); killing", "warn")
            except (Conflict, SandboxNotFound):
                return
        with contextlib.suppress(SandboxNotFound):
            await self.kill(sandbox_id, reason="killed on timeout")
