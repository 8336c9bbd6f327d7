"""Making sandboxes: create (limits, the row, the runtime's create, teardown of a failed one),
snapshots, and forks (their rows and children's start). Split from `sandboxes.py`."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from dataclasses import replace

from agentenv.contract.errors import (
    BadRequest,
    Conflict,
    CreateFailed,
    InsufficientStorage,
    TemplateNotFound,
    Unavailable,
)
from agentenv.contract.ids import new_sandbox_id
from agentenv.contract.runtime import (
    Placement,
    SandboxSpec,
    SnapshotInfo,
    TagUnavailable,
    TemplateUnavailable,
)
from agentenv.control.sandbox_base import (
    DEFAULT_TIMEOUT_S,
    CreateSpec,
    SandboxBase,
    _pause_mode,
    raise_failure,
)
from agentenv.control.store import BUILD_METADATA, DEFAULT_TEAM, SandboxRecord, SandboxState

log = logging.getLogger("agentenv.sandboxes")


def _creating(rec: SandboxRecord) -> str:
    return f"creating from template {rec.template!r}"


class SandboxCreation(SandboxBase):
    """Create, snapshot and fork of the sandbox manager."""

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
        rec, ref = await self._new_record(spec, team, api_key_id)
        async with self._locked(rec.id):
            note = _creating(rec)
            if BUILD_METADATA in rec.metadata:
                await self.store.insert(rec, note=note)
            else:
                # The place is held from the check until the row that takes it is stored.
                async with self.limits.reserve(team):
                    await self.store.insert(rec, note=note)
            await self._place(rec, ref, spec)
        self._wake.set()
        return await self.get(rec.id)

    async def create_many(
        self, spec: CreateSpec, count: int, api_key_id: str | None, team_id: str
    ) -> list[SandboxRecord]:
        """`count` sandboxes of one spec (a snapshot's fork), all or none: the team's limits
        count all of them at once, and if one cannot be made the others are killed and the
        first failure is raised."""
        recs = [(await self._new_record(spec, team_id, api_key_id)) for _ in range(count)]
        async with self.limits.reserve(team_id, count):
            for rec, _ in recs:
                await self.store.insert(rec, note=_creating(rec))
        async with contextlib.AsyncExitStack() as locks:
            for rec, _ in recs:
                await locks.enter_async_context(self._locked(rec.id))
            # One call: a node starts a snapshot's children as one batch (restored together).
            started: list[Placement | BaseException]
            try:
                started = await self.runtime.create_many(
                    [self._runtime_spec(rec, ref, spec) for rec, ref in recs]
                )
            except Exception as exc:
                # Refused as a whole (nothing made): each stored row goes as a failed create.
                started = [exc] * len(recs)
            results = await asyncio.gather(
                *(
                    self._place(rec, ref, spec, got)
                    for (rec, ref), got in zip(recs, started, strict=True)
                ),
                return_exceptions=True,
            )
        failures = [r for r in results if isinstance(r, BaseException)]
        if failures:
            made = [rec.id for (rec, _), r in zip(recs, results, strict=True) if r is None]
            for sandbox_id in made:
                try:
                    async with self._locked(sandbox_id):
                        row = await self.store.get(sandbox_id)
                        if row is not None and row.state is SandboxState.RUNNING:
                            why = f"a sandbox of its batch failed: {failures[0]}"
                            await self._kill_locked(row, why)
                except Exception as exc:
                    log.error("sandbox %s: rollback of its batch failed: %r", sandbox_id, exc)
            raise failures[0]
        self._wake.set()
        return [await self.get(rec.id) for rec, _ in recs]

    async def _new_record(
        self, spec: CreateSpec, team: str, api_key_id: str | None
    ) -> tuple[SandboxRecord, str]:
        """The row of a sandbox about to be made (not stored yet), and the template reference
        the node starts it from."""
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
            grace_s=self.timeout_grace_s if spec.grace_s is None else spec.grace_s,
            keepalive_s=spec.keepalive_s,
            seen_at=now,
        )
        if rec.grace_s or rec.keepalive_s:
            self._unattended_rows = True
        return rec, tpl.ref or rec.template

    def _runtime_spec(self, rec: SandboxRecord, ref: str, spec: CreateSpec) -> SandboxSpec:
        return replace(self._spec(rec), template=ref, capacity_wait_s=spec.capacity_wait_s)

    async def _place(
        self,
        rec: SandboxRecord,
        ref: str,
        spec: CreateSpec,
        given: Placement | BaseException | None = None,
    ) -> None:
        """Start the stored `creating` row's sandbox on the runtime (or take `given`, what a
        batch's start of it gave) and mark it running; a failure tears down what was made
        and raises what the API answers."""
        log.info(
            "sandbox %s creating template=%s",
            rec.id,
            rec.template,
            extra={"sandbox_id": rec.id, "template": rec.template},
        )
        started = time.monotonic()
        placement: Placement | None = None
        try:
            if isinstance(given, BaseException):
                raise given
            placement = given or await self.runtime.create(self._runtime_spec(rec, ref, spec))
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
                note="running",
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
        log.info(
            "sandbox %s running address=%s",
            rec.id,
            placement.address,
            extra={"sandbox_id": rec.id, "address": placement.address},
        )

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
            except Exception as exc:
                raise_failure(exc, f"sandbox {sandbox_id} was not snapshotted")
            # The guest may have moved to another QEMU (same slot, same address).
            await self.store.log(sandbox_id, f"snapshot {info.snapshot_id} {info.names}")
        return info

    async def fork(
        self, sandbox_id: str, count: int, lifetime_s: int | None, api_key_id: str | None = None
    ) -> list[SandboxRecord]:
        """`count` new running sandboxes from one capture of a running one, or of a paused
        one (which stays paused as it was: the node snapshots its files); they are the
        source's team's, within its limits. The source's row never changes: a crash during
        the fork leaves it as it was, and its children's rows (stored first, as creating)
        are finished as kills by recovery."""
        async with self._locked(sandbox_id):
            src = await self.get(sandbox_id)
            if src.state not in (SandboxState.RUNNING, SandboxState.PAUSED):
                raise Conflict(f"sandbox {sandbox_id} is {src.state.value}, not running or paused")
            if src.state is SandboxState.PAUSED and src.pause_mode == _pause_mode(memory=False):
                raise Conflict(
                    f"sandbox {sandbox_id} was paused without its memory (filesystem only): "
                    "a fork needs a pause that kept it, or the sandbox running"
                )
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
                    raise_failure(exc, f"sandbox {sandbox_id} was not forked")
                how = "" if src.state is SandboxState.RUNNING else " while paused"
                await self.store.log(sandbox_id, f"forked {len(placements)} sandbox(es){how}")
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
                # A rollout's children end as their parent would: the same grace and
                # keepalive.
                grace_s=src.grace_s,
                keepalive_s=src.keepalive_s,
                seen_at=now,
            )
            await self.store.insert(rec, note=f"forked from {sandbox_id}")
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
                origin=placement.origin,
            )
            children.append(await self.get(rec.id))
        self._wake.set()
        return children
