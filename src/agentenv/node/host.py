"""A single host's sandboxes: `create` starts one and returns when envd answers, `delete` frees
everything it held (VM, cgroup, slot, upper layer, layer and snapshot references).

With snapshots on (the default), create = resume: the template's snapshot (built once by a cold
boot, `snapshot.templates`) is restored with private copy-on-write RAM and the guest gets its
identity through envd `/init`; nobody boots a kernel, also not for a disk larger than the
template's (the restored guest's disk and ext4 are grown online). A cold boot remains the
fallback when the template snapshot cannot be built. `pause`/`resume`, `snapshot` and `fork`
use `snapshot/`; a paused sandbox lives only in its workdir, so it survives a restart of the
node. Warm pool entries (`node.warm`) live in `settings.warm_dir` until a create takes
one and moves its workdir into the sandboxes dir.

Creation is ordered so that validation happens before any resource exists, and every step
after that has its undo registered; a failure anywhere unwinds in reverse.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import json
import logging
import os
import shutil
from pathlib import Path

from agentenv import snapshot as snaps
from agentenv.cleanup import Cleanup
from agentenv.network import (
    Egress,
    Slot,
    adopted_slot,
    destroy_slot,
    marked_slot,
    recover_slots,
)
from agentenv.network.slot import NETNS_PREFIX
from agentenv.node.cleanup import (
    RESET_HOLDER,
    drop_reset_hold,
    push_record,
    push_slot,
    push_vm,
    push_workdir,
    record_slot,
)
from agentenv.node.errors import (
    SandboxError,
)
from agentenv.node.files import SandboxFiles, sandbox_files
from agentenv.node.host_reset import NodeReset
from agentenv.node.sandbox import (
    ADOPT_HEALTH_TIMEOUT_S,
    Boot,
    GuestInit,
    SandboxHandle,
    TemplateDefaults,
    claim_data_dir,
    warm_root,
)
from agentenv.snapshot import GuestImage, Machine, MemoryMode, SnapshotError
from agentenv.snapshot.machine import disk_limits, wait_envd
from agentenv.snapshot.pause import STATE, STREAM, tidy
from agentenv.vmm import registry as vm_registry
from agentenv.vmm.accel import boot_deadline, detect
from agentenv.vmm.base import VMStatus
from agentenv.vmm.qemu import QemuVM

log = logging.getLogger(__name__)

__all__ = ["GuestInit", "Node", "SandboxHandle", "TemplateDefaults"]


class Node(NodeReset):
    """A single host's sandboxes (see the module docstring); start, crash recovery, close."""

    async def start(self) -> None:
        """Detect the accelerator, resolve the guest artifacts and fill the slot pool."""
        from agentenv.template import artifacts
        from agentenv.vmm.ramshim import ensure_ram_shim

        self._accel = detect(self.settings)
        self.admission.limits = self.admission.limits.for_accel(self._accel)
        for warning in self._accel.warnings:
            log.warning("%s", warning)
        arts = await asyncio.to_thread(artifacts.ensure_all, self.settings, None)
        shim = await asyncio.to_thread(ensure_ram_shim, self.settings.cache)
        accel_name = self._accel.name
        deadline = boot_deadline(self.settings, self._accel)

        def cmdline(sandbox_id: str) -> str:
            extra = artifacts.guest_args(
                self.settings, hostname=sandbox_id, boot_timeout_s=deadline
            )
            return artifacts.kernel_cmdline(arts, accel_name, extra)

        self._boot = Boot(arts.kernel, arts.initramfs, arts.tools_image, cmdline)
        self._image = GuestImage(
            arts.kernel,
            arts.initramfs,
            arts.tools_image,
            self._accel,
            self.settings.qemu_binary,
            cmdline,
            shim,
            deadline,
            self.settings.vms_dir,
            self._vm_exited,
            confine=self.settings.confine,
            disk_limits=disk_limits(self.settings),
        )
        self.settings.sandboxes_dir.mkdir(parents=True, exist_ok=True)
        self._owner_fd = await asyncio.to_thread(claim_data_dir, self.settings.run_dir)
        if self._owner_fd is not None:
            await self._recover()
        else:
            # Another live node holds this data dir: what runs there is its own.
            log.info("another node runs on %s: no crash recovery", self.settings.home)
        if self.warm.enabled:
            self._warm_root = await asyncio.to_thread(warm_root, self.settings.warm_dir)
        await self.pool.start()
        self.memory.start()
        self.warm.start()
        # Streams an earlier node paused and did not get to convert.
        for sandbox_id, workdir in await asyncio.to_thread(self._unconverted_pauses):
            self.conversions.start(sandbox_id, workdir)

    # -- crash recovery and dying VMs ----------------------------------------------------------

    async def _recover(self) -> None:
        """Own everything an earlier server of this data dir left: adopt the running
        sandboxes' QEMUs (by their registry records), end every other QEMU it started (warm
        entries, converters, template builds, guests of an operation cut short), and free
        their slots, cgroups, files and references, each through the cleanup stack rebuilt
        from what was persisted (`node.cleanup`). A sandbox dir that neither runs nor is
        paused is lost: its whole stack runs, and the reason is kept in `lost`."""
        s = self.settings
        keep: set[int] = set()
        # Records nobody adopts, by VM name (a sandbox's is its id), with their live pid.
        left: dict[str, tuple[vm_registry.VMRecord, int | None]] = {}
        for rec in await asyncio.to_thread(vm_registry.load_all, s.vms_dir, sweep=True):
            pid = await asyncio.to_thread(vm_registry.live_pid, rec)
            if pid is not None and self._is_sandbox(rec) and not self._paused_on_disk(rec.name):
                try:
                    handle = await self._adopt(rec, pid)
                except Exception as exc:
                    why = f"its VM could not be taken over after a server restart: {exc}"
                    self.lost[rec.name] = why
                    log.warning("sandbox %s: %s", rec.name, why)
                else:
                    keep.add(handle.slot.index)
                    log.info("sandbox %s: adopted its running VM (pid %d)", rec.name, pid)
                    continue
            left[rec.name] = (rec, pid)
        for name, (rec, pid) in list(left.items()):
            if sandbox_files(s, name).workdir.is_dir() and not self._paused_on_disk(name):
                continue  # a lost sandbox's: its whole stack runs below
            # A paused sandbox's QEMU (a pause cut short), a warm entry, converter or build.
            del left[name]
            stack = Cleanup(name)
            workdir = Path(rec.workdir)
            if not self._is_sandbox(rec) and workdir.is_relative_to(s.home):
                push_workdir(stack, workdir)
            self._push_record(stack, rec, pid, keep)
            await self._unwind(stack, f"recovery of {name}")
        for workdir in await asyncio.to_thread(lambda: sorted(s.sandboxes_dir.iterdir())):
            name = workdir.name
            if name in self._sandboxes:
                continue
            if self._paused_on_disk(name):
                # A disk pause cut short after its record: RAM files, a snapshot hold.
                try:
                    await asyncio.to_thread(tidy, workdir, self.repo)
                except SnapshotError as exc:
                    log.warning("sandbox %s: %s", name, exc)
                continue
            why = self.lost.setdefault(
                name, "its VM was no longer running when the server restarted"
            )
            log.warning("sandbox %s lost: %s", name, why)
            # Its whole stack: what its files record, then the slot and QEMU its VM record
            # names, if it got one (those run first).
            stack = self._stack_on_disk(name)
            if name in left:
                self._push_record(stack, *left.pop(name), keep)
            await self._unwind(stack, f"the lost sandbox {name}")
        # Slots no stack names: the dead server's idle pool.
        removed = await recover_slots(s.network, s.slots_dir, keep)
        if removed:
            log.info("removed %d network slot(s) a previous server left", len(removed))
        await asyncio.to_thread(self._release_orphan_holders)

    def _is_sandbox(self, rec: vm_registry.VMRecord) -> bool:
        workdir = Path(rec.workdir)
        return workdir.parent == self.settings.sandboxes_dir and workdir.name == rec.name

    def _push_record(
        self, stack: Cleanup, rec: vm_registry.VMRecord, pid: int | None, keep: set[int]
    ) -> None:
        """Its slot and QEMU; not a slot an adopted sandbox runs in (`keep`)."""

        async def drop_slot(slot: Slot) -> None:
            # As the marker recorded it (its namespace's cookie): without a marker its server
            # had removed the slot already, and the name may be another process's by now.
            owner = self.settings.slots_dir
            marked = await asyncio.to_thread(marked_slot, self.settings.network, owner, slot.index)
            if marked is not None:
                await destroy_slot(marked, owner=owner)

        slot = record_slot(self.settings.network, rec)
        if slot is not None and slot.index in keep:
            slot = None
        push_record(stack, rec, pid, self.settings.vms_dir, slot, drop_slot)

    async def _adopt(self, rec: vm_registry.VMRecord, pid: int) -> SandboxHandle:
        """Take over a sandbox's QEMU that a dead server started. An operation it was in the
        middle of is rolled forward: a guest stopped for a pause or capture runs on; one
        that never got its state (a restore cut short) cannot be adopted."""
        workdir = Path(rec.workdir)
        meta = json.loads(await asyncio.to_thread((SandboxFiles(workdir).meta).read_text))
        vm = await QemuVM.adopt(
            rec,
            pid,
            accel=self.accel,
            registry=self.settings.vms_dir,
            on_exit=self._vm_exited,
            disk_limits=self.image.disk_limits,
        )
        try:
            status = await vm.status()
            if status is VMStatus.CREATED:
                raise SandboxError("its VM never received its state (a restore was cut short)")
            if status is VMStatus.PAUSED:
                await vm.resume()
            if vm.netns is None or not vm.netns.startswith(NETNS_PREFIX):
                raise SandboxError(f"its VM runs in no slot namespace ({vm.netns})")
            slot = await adopted_slot(self.settings.network, int(vm.netns[len(NETNS_PREFIX) :]))
            mem = vm.machine.mem_file
            private = mem is not None and not vm.machine.mem_shared
            # A clone maps a committed snapshot's memory (not a capture's staging dir).
            snapshot_id = None
            if mem is not None and private and mem.parent.parent == self.repo.root:
                snapshot_id = mem.parent.name
            machine = Machine(
                name=rec.name,
                workdir=workdir,
                vcpus=vm.machine.vcpus,
                memory_mb=vm.machine.memory_mb,
                slot=slot,
                vm=vm,
                memory=MemoryMode.OWN if vm.machine.mem_shared else MemoryMode.SNAPSHOT,
                tools_image=vm.drives[1].path,
                balloon=vm.machine.balloon,
                snapshot_id=snapshot_id,
            )
            await wait_envd(machine.envd_url, vm, ADOPT_HEALTH_TIMEOUT_S)
            handle = await asyncio.to_thread(
                self._handle, machine, meta["template"], meta["top_layer"]
            )
        except BaseException:
            await vm.kill()
            raise
        handle.origin = "adopted"
        # The slot's egress rules live in its namespace and outlived the server; its gateway
        # (DNS, inspecting proxy) died with it and comes back here.
        handle.egress = Egress.from_json(meta.get("egress"))
        await self.pool.adopt(slot, handle.egress)
        # Its stack, rebuilt from what was persisted: workdir, references, slot, QEMU.
        handle.cleanup = self._stack_on_disk(rec.name)
        push_slot(handle.cleanup, self.pool, slot)
        push_vm(handle.cleanup, lambda: machine.vm)
        self._sandboxes[rec.name] = handle
        # A running sandbox has no use for saved state: what is there is from a pause cut
        # short before it wrote its record.
        for leftover in (STATE, STREAM):
            await asyncio.to_thread((workdir / leftover).unlink, True)
        return handle

    def _release_orphan_holders(self) -> None:
        """References held in the layer store and snapshot catalog by a sandbox, warm entry
        or template build that no longer exists (a crash between taking and dropping)."""
        alive = {p.name for p in self.settings.sandboxes_dir.iterdir()}

        def orphan(holder: str) -> bool:
            return ":" not in holder and holder not in alive

        for holder in filter(orphan, self.layers.all_holders()):
            self.layers.unref_holder(holder)
        snapshot_holders = self.repo.all_holders()
        for holder in filter(orphan, snapshot_holders):
            self.repo.unref_holder(holder)
        # A reset cut short: its target stays for the control plane's restart of a lost
        # sandbox; one that got its new guest (adopted) holds the target itself.
        for holder in snapshot_holders:
            if holder.startswith(RESET_HOLDER):
                sandbox_id = holder.removeprefix(RESET_HOLDER)
                if sandbox_id in self._sandboxes:
                    drop_reset_hold(self.repo, sandbox_id)
                else:
                    self._reset_holds.add(sandbox_id)
        # Snapshots the dead server's last references held, and captures' staging dirs it
        # left (a kill's release does not look for those).
        self.repo.gc()

    def _unconverted_pauses(self) -> builtins.list[tuple[str, Path]]:
        found = []
        for workdir in sorted(self.settings.sandboxes_dir.iterdir()):
            try:
                record = snaps.paused_state(workdir)
            except SnapshotError:
                continue
            if record is not None and record.kind == "stream":
                found.append((workdir.name, workdir))
        return found

    async def close(self) -> None:
        """Delete every running sandbox of this node and release pooled slots. Paused
        sandboxes stay on disk: a later node resumes them."""
        await self.memory.close()
        await self.warm.close()
        await self.conversions.close()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        for sandbox_id, sb in list(self._sandboxes.items()):
            if sb.paused:
                self._sandboxes.pop(sandbox_id, None)
                continue
            with contextlib.suppress(Exception):
                await self.delete(sandbox_id)
        if self._warm_root is not None:
            await asyncio.to_thread(shutil.rmtree, self._warm_root, True)
            self._warm_root = None
        await self.pool.close()
        if self._owner_fd is not None:
            os.close(self._owner_fd)
            self._owner_fd = None

    async def __aenter__(self) -> Node:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- queries ----------------------------------------------------------------------------
