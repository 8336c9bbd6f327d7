"""Creating a sandbox: validation, then a restore of the template's snapshot, a warm pool entry,
a named snapshot or a cold boot, each step's undo registered. Split from `host.py`."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from agentenv import snapshot as snaps
from agentenv.aio import thread_whole
from agentenv.cleanup import Cleanup
from agentenv.contract.ids import is_sandbox_id, new_sandbox_id
from agentenv.faults import crash_point
from agentenv.guest.envd.client import EnvdClient, EnvdError
from agentenv.network import OPEN, Egress, Slot
from agentenv.node.cleanup import (
    drop_reset_hold,
    push_vm,
)
from agentenv.node.errors import (
    BootFailed,
    DiskTooSmallForTemplate,
    InvalidResources,
    SandboxError,
)
from agentenv.node.files import SandboxFiles, sandbox_files
from agentenv.node.host_warm import NodeWarm
from agentenv.node.sandbox import (
    GROW_FS,
    GROW_TIMEOUT_S,
    NO_INIT,
    GuestInit,
    SandboxHandle,
    TemplateDefaults,
    tail,
)
from agentenv.node.warm import Shape, snapshot_shape
from agentenv.snapshot import Machine, MemoryMode, Snapshot, SnapshotError
from agentenv.snapshot.machine import new_vm
from agentenv.snapshot.restore import Prepared, load
from agentenv.storage import (
    DiskTooSmall,
    create_upper,
)
from agentenv.vmm.errors import VMMError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BatchChild:
    """One sandbox of a `NodeCreate.create_batch`: its id and what a create would be given."""

    sandbox_id: str
    egress: Egress = OPEN
    init: GuestInit = NO_INIT
    metadata: Mapping[str, str] | None = None


class NodeCreate(NodeWarm):
    """The create paths of a `host.Node`."""

    async def create(
        self,
        template: str = "base",
        cpu: int = 1,
        memory_mb: int = 512,
        disk_size_mb: int | None = None,
        *,
        egress: Egress = OPEN,
        sandbox_id: str | None = None,
        init: GuestInit = NO_INIT,
        metadata: Mapping[str, str] | None = None,
        capacity_wait_s: float | None = None,
    ) -> SandboxHandle:
        """`egress` (`network.egress`: internet off, destinations allowed or denied) holds
        from before the guest first runs, on every resume and in its fork children. The
        sandbox runs as `sandbox_id` (a new id if None); its envd gets one `/init` with its
        hostname, clock, entropy, the template's defaults and `init`. `metadata` is kept
        with it."""
        if self._boot is None or self._accel is None:
            raise SandboxError("node is not started")
        if sandbox_id is not None and sandbox_id in self._reset_holds:
            # The restart of a reset cut short: its target is held until this create
            # holds it itself, or has failed (the sandbox is then lost).
            self._reset_holds.discard(sandbox_id)
            try:
                return await self.create(
                    template, cpu, memory_mb, disk_size_mb, egress=egress,
                    sandbox_id=sandbox_id, init=init, metadata=metadata,
                    capacity_wait_s=capacity_wait_s,
                )  # fmt: skip
            finally:
                await thread_whole(drop_reset_hold, self.repo, sandbox_id)
        if sandbox_id is not None:
            await asyncio.to_thread(self._check_new_id, sandbox_id)
        named = await asyncio.to_thread(self._named_snapshot, template)
        if named is not None:
            return await self._create_from_snapshot(
                named, template, egress, sandbox_id, init, metadata, capacity_wait_s
            )
        top, top_path, disk_mb, base_mb, defaults = await asyncio.to_thread(
            self._validate, template, cpu, memory_mb, disk_size_mb
        )
        async with self.admission.start(
            f"a create of {template!r}", memory_mb, wait_s=capacity_wait_s
        ):
            return await self._create(
                template, cpu, memory_mb, disk_size_mb, top, top_path, disk_mb, base_mb, egress,
                defaults, sandbox_id, init, metadata,
            )  # fmt: skip

    async def create_batch(
        self,
        template: str,
        children: Sequence[BatchChild],
        *,
        capacity_wait_s: float | None = None,
    ) -> list[SandboxHandle | BaseException] | None:
        """Sandboxes of one named snapshot (a snapshot's fork of N): the snapshot looked up
        once, the children admitted as one start of N (capacity for all at once, one start
        slot, as a running sandbox's fork is) and restored together, where N creates would
        each take a start slot and restore at most `max_starts` at a time. Each child's
        result is its handle or its exception (it released what it made; the caller decides
        about the others). None if `template` is not a named snapshot here (the caller
        creates them one by one)."""
        if self._boot is None or self._accel is None:
            raise SandboxError("node is not started")
        if len({c.sandbox_id for c in children}) != len(children):
            raise InvalidResources("a batch names one sandbox id twice")
        for child in children:
            await asyncio.to_thread(self._check_new_id, child.sandbox_id)
        snap = await asyncio.to_thread(self._named_snapshot, template)
        if snap is None:
            return None
        what = f"{len(children)} creates from snapshot {template!r}"
        async with self.admission.start(
            what, snap.memory_mb, len(children), wait_s=capacity_wait_s
        ):

            async def one(c: BatchChild) -> SandboxHandle:
                # Children take what warm entries of the snapshot wait (each counts as a
                # create of it); the others restore together. Taken when the child's task
                # runs, not before: a task cancelled before it starts takes nothing.
                warm = self._take_warm(snap, template)
                return await self._from_snapshot(
                    snap, template, c.egress, c.sandbox_id, c.init, c.metadata, warm=warm
                )

            results = await asyncio.gather(*(one(c) for c in children), return_exceptions=True)
        return list(results)

    def _check_new_id(self, sandbox_id: str) -> None:
        """An id the caller chose: a DNS label of ours, not held by anything here."""
        if not is_sandbox_id(sandbox_id):
            raise InvalidResources(
                f"sandbox id {sandbox_id!r} is not 'i' and 19 lowercase letters or digits"
            )
        if (
            sandbox_id in self._sandboxes
            or sandbox_files(self.settings, sandbox_id).workdir.exists()
        ):
            raise InvalidResources(f"sandbox id {sandbox_id!r} is already in use on this node")

    async def _create(
        self,
        template: str,
        cpu: int,
        memory_mb: int,
        disk_size_mb: int | None,
        top: str,
        top_path: Path,
        disk_mb: int,
        base_mb: int,
        egress: Egress,
        defaults: TemplateDefaults | None = None,
        given_id: str | None = None,
        init: GuestInit = NO_INIT,
        metadata: Mapping[str, str] | None = None,
    ) -> SandboxHandle:
        """`create` once the input is valid and the start admitted. `defaults` (the
        template's env, user and workdir for commands) and `init` reach envd in its one
        `/init`, on a restore and on a cold boot alike."""
        if self._boot is None or self._accel is None:
            raise SandboxError("node is not started")
        snap = None
        if self.snapshots:
            snap = await self._template_snapshot(template, cpu, memory_mb)
        t0 = time.monotonic()
        warm: Prepared | None = None
        if snap is not None:
            warm = self.warm.take(Shape(template, cpu, memory_mb), snap.id)
        if warm is not None:
            # The entry's steps move onto the sandbox's stack below.
            self._warm_stacks.pop(warm.name, None)
        sandbox_id = given_id or (warm.name if warm is not None else new_sandbox_id())
        workdir = sandbox_files(self.settings, sandbox_id).workdir
        # The sandbox's stack from its first acquisition on; it stays on the handle.
        stack = Cleanup(sandbox_id)
        handle: SandboxHandle | None = None
        try:
            slot = await self._acquire(sandbox_id, workdir, stack, warm, lambda: handle)
            await thread_whole(self.layers.ref, top, sandbox_id)
            if not egress.open:
                # Before the guest runs (a warm entry's QEMU waits for its state).
                await self.pool.set_egress(slot, egress)

            upper = SandboxFiles(workdir).upper
            await self._write_meta(
                workdir, template, cpu, memory_mb, disk_mb, top, egress, defaults, metadata
            )
            crash_point("create:acquired")
            if snap is not None:
                handle = await self._restore(
                    snap, sandbox_id, template, workdir, slot, top, stack, prepared=warm,
                    defaults=defaults, init=init,
                )  # fmt: skip
                handle.egress = egress
                if disk_mb > base_mb:
                    await self._grow_disk(handle, disk_mb)
                handle.boot_s = time.monotonic() - t0
                self._sandboxes[sandbox_id] = handle
                log.info("sandbox %s restored in %.2fs at %s", sandbox_id, handle.boot_s, slot)
                crash_point("create:restored")
                return handle
            try:
                await create_upper(top_path, upper, disk_mb if disk_size_mb is not None else None)
            except DiskTooSmall as exc:
                raise DiskTooSmallForTemplate(str(exc)) from exc

            vm = new_vm(
                self.image,
                name=sandbox_id,
                workdir=workdir,
                vcpus=cpu,
                memory_mb=memory_mb,
                mem_file=SandboxFiles(workdir).memory if self.mem_file else None,
                shared=True,
                upper=upper,
                tools_image=self._boot.tools_image,
                slot=slot,
                incoming=False,
            )
            booted = SandboxHandle(
                id=sandbox_id,
                template=template,
                cpu=cpu,
                memory_mb=memory_mb,
                disk_size_mb=disk_mb,
                slot=slot,
                workdir=workdir,
                upper=upper,
                top_layer=top,
                vm=vm,
                egress=egress,
                cleanup=stack,
            )
            await vm.start()
            push_vm(stack, lambda: booted.vm)
            if self.snapshots:
                booted.machine = Machine(
                    name=sandbox_id,
                    workdir=workdir,
                    vcpus=cpu,
                    memory_mb=memory_mb,
                    slot=slot,
                    vm=vm,
                    memory=MemoryMode.OWN,
                    tools_image=self._boot.tools_image,
                )
            await self._wait_healthy(booted)
            await self._init_booted(booted, defaults, init)
            now = time.monotonic()
            booted.boot_s = now - t0
            booted.spawn_to_healthy_s = now - (vm.started_at or t0)
        except BaseException:
            # The sandbox dir (and its console log) is about to go: keep the console in the log.
            console = tail(SandboxFiles(workdir).serial_log, 40)
            log.warning("create of %s failed; console tail: %s", sandbox_id, console)
            await self._unwind(stack, "the failed create")
            raise
        self._sandboxes[sandbox_id] = booted
        log.info("sandbox %s up in %.2fs at %s", sandbox_id, booted.boot_s, booted.address)
        return booted

    async def _restore(
        self,
        snap: Snapshot,
        sandbox_id: str,
        template: str,
        workdir: Path,
        slot: Slot,
        top: str,
        stack: Cleanup,
        origin: str = "restore",
        prepared: Prepared | None = None,
        defaults: TemplateDefaults | None = None,
        init: GuestInit = NO_INIT,
    ) -> SandboxHandle:
        """Restore `snap` as `sandbox_id` (into `prepared`, a warm pool's guest spawned for
        it, if given) and give it, in one `/init`, its hostname, the template's defaults and
        `init`. Its QEMU goes onto `stack` (a prepared one is there already), which the
        caller runs on failure and keeps on the handle."""
        t0 = time.monotonic()
        # The token its envd was captured with (a snapshot's record does not change).
        token = snap.envd_token
        # One client, and one connection to the guest, for the health wait and the /init.
        at = prepared.slot if prepared is not None else slot
        async with EnvdClient(snaps.envd_url(at), token) as envd:
            if prepared is not None:
                machine = await load(prepared, self.repo, self.layers, envd=envd)
            else:
                machine = await snaps.restore(
                    self.repo, self.layers, self.image, snap.id,
                    name=sandbox_id, workdir=workdir, slot=slot, envd=envd,
                )  # fmt: skip
                push_vm(stack, lambda: machine.vm)
            crash_point("create:loaded")
            handle = await asyncio.to_thread(self._handle, machine, template, top)
            handle.cleanup = stack
            handle.origin = "warm" if prepared is not None else origin
            d = defaults or TemplateDefaults()
            env = init.env_over(d)
            await snaps.identify(
                envd,
                hostname=sandbox_id,
                # The captured guest's token (if any) is replaced by the sandbox's own.
                access_token=init.envd_token or ("" if token else None),
                env_vars=env or None,
                default_user=d.user,
                default_workdir=d.workdir,
            )
        handle.envd_token = init.envd_token
        handle.spawn_to_healthy_s = time.monotonic() - t0
        return handle

    async def _grow_disk(self, handle: SandboxHandle, disk_mb: int) -> None:
        """A restored guest has the template's disk: grow the virtual disk under it, then
        its ext4 online, before anyone uses the sandbox."""
        size = disk_mb * 1024 * 1024
        t0 = time.monotonic()
        try:
            await handle.vm.resize_disk("vda", size)
            async with EnvdClient(handle.envd_url, handle.envd_token) as envd:
                res = await envd.run(
                    GROW_FS.format(sectors=size // 512),
                    user="root",
                    timeout=GROW_TIMEOUT_S,
                    shell="/bin/sh",
                )
        except (VMMError, EnvdError) as exc:
            raise BootFailed(
                f"sandbox {handle.id}: growing its disk to {disk_mb} MB failed: {exc}"
            ) from exc
        if res.exit_code != 0:
            detail = (res.stderr.strip().splitlines() or [f"exit code {res.exit_code}"])[-1]
            raise BootFailed(
                f"sandbox {handle.id}: growing its filesystem to {disk_mb} MB failed: {detail}"
            )
        handle.disk_size_mb = disk_mb
        log.info(
            "sandbox %s: disk grown to %d MB in %.2fs", handle.id, disk_mb, time.monotonic() - t0
        )

    async def _create_from_snapshot(
        self,
        snap: Snapshot,
        ref: str,
        egress: Egress,
        sandbox_id: str | None = None,
        init: GuestInit = NO_INIT,
        metadata: Mapping[str, str] | None = None,
        capacity_wait_s: float | None = None,
    ) -> SandboxHandle:
        async with self.admission.start(
            f"a create from snapshot {ref!r}", snap.memory_mb, wait_s=capacity_wait_s
        ):
            warm = self._take_warm(snap, ref)
            sandbox_id = sandbox_id or (warm.name if warm is not None else new_sandbox_id())
            return await self._from_snapshot(
                snap, ref, egress, sandbox_id, init, metadata, warm=warm
            )

    def _take_warm(self, snap: Snapshot, ref: str) -> Prepared | None:
        """A waiting warm entry of the named snapshot `snap` (created from as `ref`), its
        steps now the caller's to put on the sandbox's stack (`_from_snapshot` does); the
        snapshot's shape joins the pool at its second ask."""
        if not snap.memory:
            return None
        shape = snapshot_shape(ref, snap.vcpus, snap.memory_mb)
        warm = self.warm.take(shape, snap.id, repeated=True)
        if warm is not None:
            self._warm_stacks.pop(warm.name, None)
        return warm

    async def _from_snapshot(
        self,
        snap: Snapshot,
        ref: str,
        egress: Egress,
        sandbox_id: str,
        init: GuestInit,
        metadata: Mapping[str, str] | None,
        warm: Prepared | None = None,
    ) -> SandboxHandle:
        """A sandbox of the named snapshot `snap` (into `warm`, a warm entry of it taken by
        the caller, if given)."""
        workdir = sandbox_files(self.settings, sandbox_id).workdir
        t0 = time.monotonic()
        stack = Cleanup(sandbox_id)
        handle: SandboxHandle | None = None
        try:
            slot = await self._acquire(sandbox_id, workdir, stack, warm, lambda: handle)
            if not egress.open:
                await self.pool.set_egress(slot, egress)
            await self._write_meta(
                workdir, ref, snap.vcpus, snap.memory_mb, 0, snap.top_layer, egress,
                metadata=metadata,
            )  # fmt: skip
            if snap.memory:
                handle = await self._restore(
                    snap, sandbox_id, ref, workdir, slot, snap.top_layer, stack,
                    prepared=warm, init=init,
                )  # fmt: skip
            else:
                handle = await self._boot_snapshot(snap, sandbox_id, ref, workdir, slot, stack)
                await self._init_booted(handle, None, init)
            handle.egress = egress
        except BaseException:
            await self._unwind(stack, "the failed create")
            raise
        handle.boot_s = time.monotonic() - t0
        self._sandboxes[sandbox_id] = handle
        return handle

    async def _boot_snapshot(
        self, snap: Snapshot, sandbox_id: str, ref: str, workdir: Path, slot: Slot, stack: Cleanup
    ) -> SandboxHandle:
        """A sandbox from a filesystem-only snapshot: a cold boot over a fresh upper on its
        top layer (which the sandbox holds), in the snapshot's shape. What it takes goes
        onto `stack` (its references are the sandbox's: dropped by the caller's stack)."""
        t0 = time.monotonic()
        top = snap.top_layer
        try:
            await thread_whole(self.layers.ref, top, sandbox_id)
            upper = SandboxFiles(workdir).upper
            await create_upper(await asyncio.to_thread(self.layers.path, top), upper, None)
            machine = await snaps.boot(
                self.image,
                name=sandbox_id,
                workdir=workdir,
                vcpus=snap.vcpus,
                memory_mb=snap.memory_mb,
                upper=upper,
                slot=slot,
            )
            push_vm(stack, lambda: machine.vm)
            handle = await asyncio.to_thread(self._handle, machine, ref, top)
        except (SnapshotError, VMMError) as exc:
            raise BootFailed(
                f"sandbox {sandbox_id} from snapshot {ref!r}: {exc}; console: "
                f"{tail(SandboxFiles(workdir).serial_log)}"
            ) from exc
        handle.cleanup = stack
        handle.origin = "boot"
        handle.booted = True
        handle.spawn_to_healthy_s = time.monotonic() - t0
        return handle
