"""Pause, resume, snapshot and fork (of a running or a paused sandbox) of a node's sandboxes.
Split from `host.py`."""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import json
import logging
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from agentenv import snapshot as snaps
from agentenv.cleanup import Cleanup, CleanupFailed
from agentenv.contract.ids import new_sandbox_id
from agentenv.network import Egress
from agentenv.node.cleanup import SLOT, VM, WARM_LINK, push_refs, push_slot, push_vm, push_workdir
from agentenv.node.errors import (
    BootFailed,
    SandboxError,
    SandboxNotPaused,
    UnknownSandbox,
)
from agentenv.node.files import SandboxFiles, sandbox_files
from agentenv.node.host_create import NodeCreate
from agentenv.node.sandbox import (
    NO_INIT,
    GuestInit,
    SandboxHandle,
    defaults_of,
    meta_defaults,
)
from agentenv.snapshot import Machine, Snapshot, SnapshotError
from agentenv.snapshot.fork import MAX_CHILDREN, ForkTarget
from agentenv.snapshot.pause import DISK
from agentenv.vmm.qemu import QemuVM

log = logging.getLogger(__name__)


class NodePause(NodeCreate):
    """Pause, resume, snapshot and fork of a `host.Node`."""

    async def pause(
        self,
        sandbox_id: str,
        *,
        memory: bool = True,
        envd_token: str | None = None,
        strict: bool = True,
    ) -> None:
        """Save the sandbox into its workdir; its QEMU exits and its slot is released.
        `memory=False`: its disk only (synced through envd with `envd_token`; `strict`:
        refused with `GuestSyncFailed` while envd cannot sync, see `snapshot.pause_disk`)."""
        sb, machine = self._machine(sandbox_id)
        try:
            if memory:
                async with self.memory.hold(sandbox_id):
                    record = await snaps.pause(machine, self.repo, self.image)
            else:
                record = await snaps.pause_disk(
                    machine, self.repo, self.image, envd_token=envd_token, strict=strict
                )
        except snaps.GuestSyncFailed:
            raise
        except SnapshotError as exc:
            raise SandboxError(str(exc)) from exc
        sb.paused = True
        if record.kind == "stream":
            self.conversions.start(sandbox_id, machine.workdir)
        # Its QEMU has exited; the slot goes back now, the rest stays until delete.
        sb.cleanup.drop(VM)
        await sb.cleanup.release(WARM_LINK)
        await sb.cleanup.release(SLOT)
        # A paused sandbox no longer maps the snapshot it came from; it may have been the
        # last holder of a deleted one.
        await asyncio.to_thread(self.repo.gc)

    async def resume(
        self, sandbox_id: str, *, memory: bool = True, init: GuestInit = NO_INIT
    ) -> SandboxHandle:
        """Bring a paused sandbox back on a free slot (also one paused by an earlier node).
        A filesystem-only pause, or `memory=False`, comes back by a cold boot over its disk
        (`handle.booted`) whose new envd gets the full `/init` of a create (the recorded
        template defaults and `init`); the saved RAM of a memory pause is then dropped. A
        guest resumed with its memory gets a new clock and entropy (with `init.envd_token`,
        which it already holds). If that `/init` fails it is paused again, as it was."""
        sb = self._sandboxes.get(sandbox_id)
        if sb is not None and not sb.paused:
            raise SandboxNotPaused(f"sandbox {sandbox_id} is running")
        if sb is None:
            record = await asyncio.to_thread(self._paused_record, sandbox_id)
            memory_mb = record.memory_mb
        else:
            memory_mb = sb.memory_mb
        async with self.admission.start(f"a resume of {sandbox_id}", memory_mb):
            sb = await self._resume(sandbox_id, memory)
            try:
                if sb.booted:
                    meta = await asyncio.to_thread(SandboxFiles(sb.workdir).meta.read_text)
                    await self._init_booted(sb, defaults_of(json.loads(meta)), init)
                else:
                    sb.envd_token = init.envd_token
                    await self.reinit(sandbox_id)
            except BaseException as exc:
                # Back to how it was: paused, its disk only if it was booted from its disk.
                try:
                    await self.pause(
                        sandbox_id, memory=not sb.booted, envd_token=init.envd_token,
                        strict=False,
                    )  # fmt: skip
                except Exception:
                    log.exception("sandbox %s: pausing again after a failed /init", sandbox_id)
                if isinstance(exc, Exception) and not isinstance(exc, BootFailed):
                    raise BootFailed(
                        f"sandbox {sandbox_id} resumed but its envd refused /init: {exc}"
                    ) from exc
                raise
            return sb

    def _paused_record(self, sandbox_id: str) -> snaps.PausedState:
        record = None
        if self._paused_on_disk(sandbox_id):
            record = snaps.paused_state(sandbox_files(self.settings, sandbox_id).workdir)
        if record is None:
            raise UnknownSandbox(f"sandbox {sandbox_id!r} does not exist")
        return record

    async def _resume(self, sandbox_id: str, memory: bool) -> SandboxHandle:
        sb = self._sandboxes.get(sandbox_id)
        if sb is not None and not sb.paused:
            raise SandboxNotPaused(f"sandbox {sandbox_id} is running")
        if sb is None and not self._paused_on_disk(sandbox_id):
            raise UnknownSandbox(f"sandbox {sandbox_id!r} does not exist")
        workdir = sandbox_files(self.settings, sandbox_id).workdir
        t0 = time.monotonic()
        await self.conversions.settle(sandbox_id)
        meta = json.loads(await asyncio.to_thread(SandboxFiles(workdir).meta.read_text))
        egress = Egress.from_json(meta.get("egress"))
        stack = sb.cleanup if sb is not None else self._stack_on_disk(sandbox_id)
        slot = await self.pool.acquire()
        push_slot(stack, self.pool, slot)
        booted = False
        try:
            if not egress.open:
                await self.pool.set_egress(slot, egress)
            record = await asyncio.to_thread(snaps.paused_state, workdir)
            booted = not memory or (record is not None and record.kind == DISK)
            machine = await snaps.resume(
                workdir,
                self.image,
                slot,
                memory=memory,
            )
        except BaseException as exc:
            with contextlib.suppress(CleanupFailed):
                await stack.release(SLOT)
            if isinstance(exc, snaps.ResumedButLost):
                await self.delete(sandbox_id)
            raise
        push_vm(stack, lambda: machine.vm)
        if sb is None:
            sb = self._handle(machine, meta["template"], meta["top_layer"])
            sb.egress = egress
            sb.cleanup = stack
            self._sandboxes[sandbox_id] = sb
        sb.machine, sb.vm, sb.slot, sb.upper, sb.paused, sb.booted = (
            machine,
            machine.vm,
            slot,
            machine.upper,
            False,
            booted,
        )
        sb.spawn_to_healthy_s = sb.boot_s = time.monotonic() - t0
        return sb

    async def snapshot(
        self,
        sandbox_id: str,
        name: str | None = None,
        envd_token: str | None = None,
        *,
        memory: bool = True,
    ) -> Snapshot:
        """A persistent snapshot of a running sandbox (which keeps running); other sandboxes
        start from it by name. Unnamed ones get a generated name. `memory=False`: its disk
        only (`snapshot.capture_disk`); creates from it cold-boot."""
        sb, machine = self._machine(sandbox_id)
        label = name or f"snapshot-{secrets.token_hex(6)}"
        if not memory:
            cap = await snaps.capture_disk(
                machine, self.repo, self.layers, self.image, names=[label], envd_token=envd_token
            )
            sb.vm, sb.upper = machine.vm, machine.upper
            return cap.snapshot
        async with self.memory.hold(sandbox_id):
            cap = await snaps.capture(
                machine,
                self.repo,
                self.layers,
                self.image,
                keep_running=True,
                names=[label],
                envd_token=envd_token,
            )
        sb.vm, sb.upper = machine.vm, machine.upper
        return cap.snapshot

    async def fork(
        self,
        sandbox_id: str,
        count: int,
        envd_token: str | None = None,
        *,
        children: Sequence[tuple[str, GuestInit]] | None = None,
    ) -> builtins.list[SandboxHandle]:
        """`count` new sandboxes from one capture of a running sandbox, which keeps running,
        or of a paused one's files, which stays paused as it was (also one paused by an
        earlier node); admitted as `count` starts of its size. `children`: each child's id
        and what its envd's one `/init` carries (its token, env vars); else new ids and no
        token. `envd_token`: the token the source's envd holds."""
        source = await self._fork_source(sandbox_id)
        if children is not None:
            count = len(children)
            for child_id, _init in children:
                await asyncio.to_thread(self._check_new_id, child_id)
        async with self.admission.start(f"a fork of {sandbox_id}", source.memory_mb, count):
            return await self._fork(source, count, envd_token, children)

    async def _fork_source(self, sandbox_id: str) -> _ForkSource:
        sb = self._sandboxes.get(sandbox_id)
        if sb is not None and not sb.paused:
            sb, machine = self._machine(sandbox_id)
            return _ForkSource(
                sandbox_id, sb.template, sb.cpu, sb.memory_mb, sb.workdir, sb.egress, sb, machine
            )
        if not self._paused_on_disk(sandbox_id):
            raise UnknownSandbox(f"sandbox {sandbox_id!r} does not exist")
        workdir = sandbox_files(self.settings, sandbox_id).workdir
        meta = json.loads(await asyncio.to_thread(SandboxFiles(workdir).meta.read_text))
        return _ForkSource(
            sandbox_id,
            str(meta["template"]),
            int(meta["cpu"]),
            int(meta["memory_mb"]),
            workdir,
            Egress.from_json(meta.get("egress")),
            sb,
            None,
        )

    async def _fork(
        self,
        source: _ForkSource,
        count: int,
        envd_token: str | None,
        children: Sequence[tuple[str, GuestInit]] | None = None,
    ) -> builtins.list[SandboxHandle]:
        sandbox_id, machine = source.sandbox_id, source.machine
        if machine is not None:
            # Still running, and still the same guest (not paused meanwhile).
            _, machine = self._machine(sandbox_id)
        elif not self._paused_on_disk(sandbox_id):
            raise UnknownSandbox(f"sandbox {sandbox_id!r} does not exist")
        if not 1 <= count <= MAX_CHILDREN:
            raise SandboxError(f"fork count must be between 1 and {MAX_CHILDREN}, got {count}")
        named = (
            list(children)
            if children is not None
            else [(new_sandbox_id(), NO_INIT) for _ in range(count)]
        )
        targets: list[ForkTarget] = []
        # Each child's stack, from its workdir on; a child's QEMU joins it once restored.
        stacks: dict[str, Cleanup] = {}
        loop = asyncio.get_running_loop()
        futures: list[asyncio.Future[ForkTarget]] = [loop.create_future() for _ in range(count)]

        async def setup() -> None:
            # One at a time (a slot build takes a host-wide lock, ~60 ms under TCG), while
            # the capture and the first children's restores run.
            try:
                for fut, (child_id, child_init) in zip(futures, named, strict=True):
                    workdir = sandbox_files(self.settings, child_id).workdir
                    # Synchronous (one mkdir), so that no cancel falls between it and its undo.
                    workdir.mkdir(0o700)
                    stack = stacks[child_id] = Cleanup(child_id)
                    push_workdir(stack, workdir)
                    push_refs(stack, child_id, self.layers, self.repo)
                    slot = await self.pool.acquire()
                    push_slot(stack, self.pool, slot)
                    targets.append(
                        ForkTarget(
                            child_id,
                            workdir,
                            slot,
                            access_token=child_init.envd_token,
                            env_vars=child_init.env_vars or None,
                        )
                    )
                    if not source.egress.open:
                        # The children inherit the source's policy before they run.
                        await self.pool.set_egress(slot, source.egress)
                    fut.set_result(targets[-1])
            except BaseException as exc:
                err = exc if isinstance(exc, Exception) else SandboxError("fork: setup cancelled")
                for fut in futures:
                    if not fut.done():
                        fut.set_exception(err)
                raise

        setup_task = asyncio.create_task(setup())
        try:
            if machine is None:
                # Its RAM stream's conversion, if one runs, is what the capture needs first.
                await self.conversions.settle(sandbox_id)
                res = await snaps.fork_paused(
                    source.workdir,
                    futures,
                    self.repo,
                    self.layers,
                    self.image,
                    envd_token=envd_token,
                    concurrency=self.settings.max_starts,
                )
            else:
                async with self.memory.hold(sandbox_id):
                    res = await snaps.fork(
                        machine,
                        futures,
                        self.repo,
                        self.layers,
                        self.image,
                        envd_token=envd_token,
                        concurrency=self.settings.max_starts,
                    )
            await setup_task
        except BaseException:
            setup_task.cancel()
            await asyncio.wait([setup_task])
            # A setup error reached the caller through fork (or fork failed first): retrieved.
            if not setup_task.cancelled():
                setup_task.exception()
            for fut in futures:
                if fut.done() and not fut.cancelled():
                    fut.exception()
            # The children fork restored it has released; the rest of each is here.
            for stack in stacks.values():
                await self._unwind(stack, "the failed fork")
            raise
        if machine is not None and source.handle is not None:
            source.handle.vm, source.handle.upper = machine.vm, machine.upper
        for child in res.children:
            push_vm(stacks[child.name], _current_vm(child))
        handles = []
        try:
            top = res.capture.snapshot.top_layer
            inherited = await asyncio.to_thread(meta_defaults, source.workdir)
            for child in res.children:
                await self._write_meta(
                    child.workdir,
                    source.template,
                    source.cpu,
                    source.memory_mb,
                    0,
                    top,
                    source.egress,
                    inherited,
                )
                h = await asyncio.to_thread(self._handle, child, source.template, top)
                h.cleanup = stacks[child.name]
                h.origin = "fork"
                h.envd_token = dict(named).get(child.name, NO_INIT).envd_token
                h.egress = source.egress
                handles.append(h)
        except BaseException:
            for stack in stacks.values():
                await self._unwind(stack, "the failed fork")
            raise
        for h in handles:
            self._sandboxes[h.id] = h
        return handles


@dataclass(frozen=True)
class _ForkSource:
    """What a fork needs of its source: a running sandbox (`machine`) or a paused one (None:
    its files in `workdir`; `handle` is None for one paused by an earlier node)."""

    sandbox_id: str
    template: str
    cpu: int
    memory_mb: int
    workdir: Path
    egress: Egress
    handle: SandboxHandle | None
    machine: Machine | None


def _current_vm(machine: Machine) -> Callable[[], QemuVM]:
    return lambda: machine.vm
