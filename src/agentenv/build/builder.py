"""Runs template builds: one build sandbox per build, the steps through its envd, a disk
snapshot per filesystem step (the step cache), then the start command, the ready check
and a memory snapshot named after the template (a create from it is a restore with the
start command already running).

A build is an asyncio task owned by `Builder`; its record says where it is, so a server that
restarts marks a build it finds `building` as failed (and kills its sandbox) instead of leaving
it stuck. In a cluster the records are shared: a build carries the id of the replica running
it (`runner`), and each replica fails only the builds whose runner is no longer alive (at its
start and every `SWEEP_S`), never another live replica's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any

from agentenv.build.guest_steps import TAIL_LINES, GuestSteps
from agentenv.build.progress import BuildProgress, receiver
from agentenv.build.spec import BuildSpec, chain_key
from agentenv.build.state import BuildRecord, BuildStore, TemplateRecord
from agentenv.build.steps import (
    DEFAULT_USER,
    DEFAULT_WORKDIR,
    Context,
    StepFailed,
    cache_name,
    describe,
    final_name,
    workdir_script,
)
from agentenv.build.templates import image_template_name
from agentenv.config import Settings
from agentenv.contract.errors import SandboxNotFound
from agentenv.contract.runtime import SNAPSHOT_ID, ImportEvent, SnapshotInfo, TemplateUnavailable
from agentenv.control.sandbox_base import CreateSpec
from agentenv.control.sandboxes import SandboxManager
from agentenv.control.store import BUILD_METADATA, DEFAULT_TEAM, SandboxRecord
from agentenv.oci.progress import LayerProgress

log = logging.getLogger("agentenv.build")

# The build sandbox outlives no build: it is killed at the end, this is the backstop.
BUILD_SANDBOX_TIMEOUT_S = 6 * 3600
# How often a cluster's replica looks for builds whose runner died.
SWEEP_S = float(os.environ.get("AGENTENV_BUILD_SWEEP_S", "10"))


class Builder:
    """`runner`/`live_runners`: this replica's id and the ids of the live replicas, in a
    cluster (both None on one server, where every unfinished build is this server's)."""

    def __init__(
        self,
        manager: SandboxManager,
        settings: Settings,
        state: BuildStore,
        *,
        runner: str | None = None,
        live_runners: Callable[[], Awaitable[set[str]]] | None = None,
        shared: bool = False,
    ) -> None:
        self.manager = manager
        self.settings = settings
        self.state = state
        self.guest = GuestSteps(state, manager.runtime)
        self.runner = runner
        self.live_runners = live_runners
        # Records shared with other replicas: without knowing who is alive, fail nothing.
        self.shared = shared
        self._sweeper: asyncio.Task[None] | None = None
        self._tasks: dict[str, asyncio.Task[None]] = {}
        # Image pulls of running builds, per build id (the progress route reads them); kept
        # until the build ends, so a client that polls late still sees every layer complete.
        self.pulls: dict[str, BuildProgress] = {}

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        """Builds a previous server left unfinished failed with it; their sandboxes go."""
        await self._fail_orphans()
        if self.live_runners is not None:
            self._sweeper = asyncio.create_task(self._sweep_forever(), name="build-sweeper")

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_S)
            try:
                await self._fail_orphans()
            except Exception:
                log.warning("build sweep failed; trying again in %.0f s", SWEEP_S, exc_info=True)

    async def _fail_orphans(self) -> None:
        """Fails every unfinished build nobody runs: on one server, each one this server does
        not run (a previous server's); in a cluster, each whose runner is not alive."""
        if self.shared and self.live_runners is None:
            return
        live = await self.live_runners() if self.live_runners is not None else set()
        for rec in await self.state.builds():
            if rec.status not in ("building", "waiting") or rec.build_id in self._tasks:
                continue
            if rec.status == "waiting" and rec.spec is None:
                continue  # requested, never started: the client may still start it
            if self.live_runners is not None and (rec.runner in live or rec.runner == self.runner):
                continue
            stale = rec.status
            rec.status = "error"
            rec.finished_at = time.time()
            who = "its control-plane replica stopped" if self.runner else "a server restart"
            rec.reason = {"message": f"the build was interrupted by {who}"}
            if not await self.state.put_build(rec, expect_status=stale):
                continue  # another replica settled it first
            self.state.log(rec.build_id, rec.reason["message"], "error")
            await self.state.flush_logs(rec.build_id)
            await self._kill(rec.sandbox_id, "build interrupted")

    async def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
            self._sweeper = None
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    def running(self, build_id: str) -> bool:
        return build_id in self._tasks

    async def submit(self, rec: BuildRecord, spec: BuildSpec, api_key_id: str | None) -> bool:
        """Starts the build; False if it had been started already (here or on another
        replica: the move out of `waiting` is one compare-and-set)."""
        rec.status = "building"
        rec.spec = spec.to_json()
        rec.runner = self.runner
        if not await self.state.put_build(rec, expect_status="waiting"):
            return False
        task = asyncio.create_task(self._run(rec, spec, api_key_id), name=f"build-{rec.build_id}")
        self._tasks[rec.build_id] = task
        task.add_done_callback(lambda _: self._forget(rec.build_id))
        return True

    def _forget(self, build_id: str) -> None:
        self._tasks.pop(build_id, None)
        self.pulls.pop(build_id, None)

    async def _kill(self, sandbox_id: str | None, reason: str) -> None:
        if sandbox_id is None:
            return
        with contextlib.suppress(SandboxNotFound):
            await asyncio.shield(self.manager.kill(sandbox_id, reason=reason))

    # -- one build -------------------------------------------------------------------------

    async def _run(self, rec: BuildRecord, spec: BuildSpec, api_key_id: str | None) -> None:
        started = time.monotonic()
        bid = rec.build_id
        try:
            try:
                snapshot_id = await self._build(rec, spec, api_key_id)
            finally:
                # Before the record says the build is over: a client that sees `error` (or
                # `ready`) finds the build sandbox, its disk and its QEMU gone already.
                await self._kill(rec.sandbox_id, "build finished")
        except asyncio.CancelledError:
            await asyncio.shield(
                self._finish(rec, "error", {"message": "the build was cancelled: server shutdown"})
            )
            raise
        except StepFailed as exc:
            tail = [line.wire() for line in (await self.state.logs(bid))[-TAIL_LINES:]]
            self.state.log(bid, exc.message, "error", exc.step)
            await self._finish(
                rec, "error", {"message": exc.message, "step": exc.step, "logEntries": tail}
            )
        except Exception as exc:
            log.exception("build %s failed", bid)
            msg = f"build failed: {type(exc).__name__}: {exc}"
            self.state.log(bid, msg, "error")
            await self._finish(rec, "error", {"message": msg})
        else:
            rec.snapshot_id = snapshot_id
            self.state.log(bid, f"Build finished in {time.monotonic() - started:.1f}s")
            await self._finish(rec, "ready", None)
            await self._publish(rec)

    async def _finish(self, rec: BuildRecord, status: str, reason: dict[str, Any] | None) -> None:
        # Every line first: a client that sees the end sees the whole log.
        await self.state.flush_logs(rec.build_id)
        rec.status = status
        rec.reason = reason
        rec.finished_at = time.time()
        if not await self.state.put_build(rec, expect_status="building"):
            # Settled by a sweep that took this replica for dead (etcd cut it off too long).
            log.warning("build %s: its record was settled elsewhere; %s not recorded",
                        rec.build_id, status)  # fmt: skip

    async def _publish(self, rec: BuildRecord) -> None:
        def tag(tpl: TemplateRecord | None) -> TemplateRecord | None:
            if tpl is None:
                return None
            for t in rec.tags:
                tpl.tags[t] = rec.build_id
            tpl.updated_at = time.time()
            return tpl

        await self.state.update_template(rec.template_id, tag)

    async def _base_identity(self, rec: BuildRecord, spec: BuildSpec) -> tuple[str, str, Context]:
        """The template a build sandbox starts from, what identifies its contents, and the
        context its steps start in: an image's config (Env, User, WorkingDir) where it says,
        E2B's defaults elsewhere."""
        if spec.from_image:
            name = await self._import_image(rec, spec)
        else:
            assert spec.from_template is not None
            name = spec.from_template
        try:
            found = await self.manager.templates.get(name)
        except TemplateUnavailable as exc:
            raise StepFailed("base", f"base template {name!r} not found: {exc}") from None
        if found.ref:
            # A built template's `name[:tag]` is the snapshot of the build it names.
            return found.ref, f"snapshot:{found.ref}", Context()
        if found.layers:
            # A catalog template (here, or as the cluster's nodes publish it).
            ctx = Context(
                envs=dict(found.env),
                user=found.user or DEFAULT_USER,
                workdir=found.workdir or DEFAULT_WORKDIR,
            )
            return name, f"layers:{','.join(found.layers)}", ctx
        if found.snapshot_id:
            # A snapshot created from by name.
            return name, f"snapshot:{found.snapshot_id}", Context()
        if SNAPSHOT_ID.fullmatch(name):
            # A cluster's snapshot, on its nodes and in the bucket, not in this replica's
            # repository (the template source accepted it).
            return name, f"snapshot:{name}", Context()
        raise StepFailed("base", f"base template {name!r} not found")

    async def _import_image(self, rec: BuildRecord, spec: BuildSpec) -> str:
        """The image becomes a catalog template where sandboxes run (this host, or one node
        of a cluster, which the build sandbox is then placed on)."""
        assert spec.from_image is not None
        name = image_template_name(spec.from_image)
        loop = asyncio.get_running_loop()
        self.state.log(rec.build_id, f"Pulling image {spec.from_image}", step="base")

        def note(message: str) -> None:
            loop.call_soon_threadsafe(self.state.log, rec.build_id, message, "info", "base")

        creds = None
        if spec.credentials is not None:
            creds = (spec.credentials.username, spec.credentials.password)
        tracker = BuildProgress(spec.from_image)
        self.pulls[rec.build_id] = tracker
        on_layer = receiver(tracker, loop, note)

        def on_event(event: ImportEvent) -> None:
            if event.layer is not None:
                on_layer(LayerProgress(**event.layer))
            else:
                note(event.message)

        try:
            tpl = await self.manager.runtime.import_image(spec.from_image, name, creds, on_event)
        except Exception as exc:
            raise StepFailed("base", f"image {spec.from_image}: {exc}") from exc
        return tpl.name or name

    async def _build(self, rec: BuildRecord, spec: BuildSpec, api_key_id: str | None) -> str:
        bid = rec.build_id
        n = len(spec.steps)
        self.state.log(bid, f"Building template {rec.template_id} from {spec.base}", step="base")
        base_name, base_id, ctx = await self._base_identity(rec, spec)
        keys: list[str] = []
        # The step cache is per team: a RUN's output (a generated secret, a private
        # download) must not serve another team's build. The default team keeps the keys
        # it had before teams existed, so its cache stays warm.
        root: dict[str, object] = {"base": base_id}
        team = await self.manager.team_of_key(api_key_id)
        if team != DEFAULT_TEAM:
            root["team"] = team
        parent = chain_key("", root)
        for step in spec.steps:
            parent = chain_key(parent, step.identity())
            keys.append(parent)
        final = chain_key(
            keys[-1] if keys else chain_key("", root),
            {
                "start": spec.start_cmd,
                "ready": spec.ready_cmd,
                "cpu": rec.cpu,
                "memory": rec.memory_mb,
            },
        )
        # Docker's rule: a forced step invalidates itself and every step after it.
        forced_from = 0 if spec.force else next((i for i, s in enumerate(spec.steps) if s.force), n)
        usable = forced_from == n and not spec.force
        cached = await self._snapshot(final_name(final)) if usable else None
        if cached is not None:
            for i, step in enumerate(spec.steps):
                self.state.log(bid, f"CACHED [{i + 1}/{n}] {describe(step)}", step=str(i + 1))
            self.state.log(bid, "Template snapshot reused from the cache", step="finalize")
            await self._record_shape(rec, cached)
            return cached
        # The longest cached prefix: the last filesystem step before any forced one whose
        # result is on disk.
        resume_at, start_from = 0, base_name
        for i in range(min(forced_from, n) - 1, -1, -1):
            if spec.steps[i].type not in ("RUN", "COPY"):
                continue
            step_snap = await self._snapshot(cache_name(keys[i]))
            if step_snap is not None:
                # By id: a cluster's replicas resolve ids, not the builder's names.
                resume_at, start_from = i + 1, step_snap
                break
        for i in range(resume_at):
            ctx.apply(spec.steps[i])
            self.state.log(bid, f"CACHED [{i + 1}/{n}] {describe(spec.steps[i])}", step=str(i + 1))
        sandbox = await self._sandbox(rec, start_from, api_key_id)
        for i in range(resume_at, n):
            step = spec.steps[i]
            label = str(i + 1)
            self.state.log(bid, f"[{i + 1}/{n}] {describe(step)}", step=label)
            t0 = time.monotonic()
            if step.type == "RUN":
                await self.guest.run_step(rec, sandbox, step, ctx, label)
            elif step.type == "COPY":
                await self.guest.copy_step(rec, sandbox, step, ctx, label)
            else:
                ctx.apply(step)
                if step.type == "WORKDIR":
                    await self.guest.sh(rec, sandbox, workdir_script(ctx.workdir, ctx.user), label)
                continue
            if step.type in ("RUN", "COPY"):
                await self._capture_disk(rec, sandbox, cache_name(keys[i]), label)
            self.state.log(bid, f"step {label} done in {time.monotonic() - t0:.1f}s", step=label)
        return await self._finalize(rec, spec, sandbox, ctx, final)

    async def _snapshot(self, name: str) -> str | None:
        return await self.state.snapshot_named(name)

    async def _take(self, sandbox: SandboxRecord, name: str, *, memory: bool) -> SnapshotInfo:
        info = await self.manager.snapshot(sandbox.id, name, memory=memory)
        await self.state.name_snapshot(name, info.snapshot_id)
        return info

    async def _record_shape(self, rec: BuildRecord, snapshot_id: str) -> None:
        """What the template is (its shape, kept on the record for replicas without the
        snapshot's files)."""
        rec.snapshot_id = snapshot_id
        if rec.snapshot_cpu is None:
            for info in await self.manager.snapshots():
                if info.snapshot_id == snapshot_id:
                    rec.snapshot_cpu, rec.snapshot_memory_mb = info.cpu, info.memory_mb
                    break
        if rec.snapshot_cpu is None:
            rec.snapshot_cpu = rec.cpu or self.settings.default_cpu
            rec.snapshot_memory_mb = rec.memory_mb or self.settings.default_memory_mb
        rec.snapshot_envd_version = self.manager.envd_version

    async def _sandbox(
        self, rec: BuildRecord, template: str, api_key_id: str | None
    ) -> SandboxRecord:
        self.state.log(rec.build_id, f"Starting the build sandbox from {template}", step="base")
        t0 = time.monotonic()
        spec = CreateSpec(
            template=template,
            timeout=BUILD_SANDBOX_TIMEOUT_S,
            metadata={BUILD_METADATA: rec.build_id},
            cpu=rec.cpu,
            memory_mb=rec.memory_mb,
        )
        try:
            sandbox = await self.manager.create(spec, api_key_id)
        except Exception as exc:
            raise StepFailed("base", f"the build sandbox did not start: {exc}") from exc
        rec.sandbox_id = sandbox.id
        await self.state.put_build(rec)
        self.state.log(
            rec.build_id,
            f"Build sandbox {sandbox.id} running after {time.monotonic() - t0:.1f}s",
            step="base",
        )
        return sandbox

    async def _capture_disk(
        self, rec: BuildRecord, sandbox: SandboxRecord, name: str, label: str
    ) -> None:
        try:
            await self._take(sandbox, name, memory=False)
        except Exception as exc:
            # The cache is an optimisation: a step whose result could not be kept still counts.
            self.state.log(rec.build_id, f"step {label} not cached: {exc}", "warn", label)

    async def _finalize(
        self, rec: BuildRecord, spec: BuildSpec, sandbox: SandboxRecord, ctx: Context, final: str
    ) -> str:
        bid = rec.build_id
        await self.guest.start(rec, sandbox, spec, ctx)
        self.state.log(bid, "Capturing the template snapshot", step="finalize")
        t0 = time.monotonic()
        try:
            info = await self._take(sandbox, final_name(final), memory=True)
        except Exception as exc:
            raise StepFailed("finalize", f"the template snapshot failed: {exc}") from exc
        rec.snapshot_cpu, rec.snapshot_memory_mb = info.cpu, info.memory_mb
        await self._record_shape(rec, info.snapshot_id)
        self.state.log(
            bid,
            f"Template snapshot {info.snapshot_id[:12]} in {time.monotonic() - t0:.1f}s",
            step="finalize",
        )
        return info.snapshot_id


def template_record(template_id: str) -> TemplateRecord:
    now = time.time()
    return TemplateRecord(template_id=template_id, name=template_id, created_at=now, updated_at=now)
