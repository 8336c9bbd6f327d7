"""Start a guest from a repository snapshot: private copy-on-write RAM, a fresh disk upper."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from agentenv.aio import thread_whole
from agentenv.cleanup import Cleanup, CleanupFailed
from agentenv.files import ROOTFS
from agentenv.guest.envd.client import EnvdClient
from agentenv.network import Slot
from agentenv.snapshot.errors import IncompatibleSnapshot, RestoreFailed
from agentenv.snapshot.machine import (
    RESTORE_HEALTH_TIMEOUT_S,
    GuestImage,
    Machine,
    MemoryMode,
    new_vm,
    wait_envd,
)
from agentenv.snapshot.model import Snapshot
from agentenv.snapshot.repository import SnapshotStore
from agentenv.storage import LayerStore, create_upper_sync
from agentenv.vmm.errors import VMMError
from agentenv.vmm.qemu import QemuVM
from agentenv.vmm.qemu_argv import DEVICE_SET

log = logging.getLogger(__name__)


def check_compatible(
    what: str,
    image: GuestImage,
    *,
    accel: str,
    qemu_version: str,
    tools_image: str,
    device_set: str,
) -> None:
    if accel != image.accel.name:
        raise IncompatibleSnapshot(
            f"{what} needs accelerator {accel}, this host uses {image.accel.name}"
        )
    if qemu_version != image.qemu_version:
        raise IncompatibleSnapshot(
            f"{what} was taken with QEMU {qemu_version}, this host has {image.qemu_version}"
        )
    if device_set != DEVICE_SET:
        raise IncompatibleSnapshot(
            f"{what} was taken with guest device set {device_set}; this agentenv gives guests "
            f"device set {DEVICE_SET} (delete it and capture it again)"
        )
    if not Path(tools_image).is_file():
        raise IncompatibleSnapshot(f"{what} needs tools layer {tools_image}, which is gone")


@dataclass
class Prepared:
    """A guest waiting for its state: QEMU spawned with `-incoming defer` over the snapshot's
    memory file, its fresh disk upper made, references taken under `name`. `cleanup` holds
    their undo (not the workdir or slot, which belong to the caller): `discard` runs it."""

    snap: Snapshot
    name: str
    workdir: Path
    slot: Slot
    upper: Path
    vm: QemuVM
    cleanup: Cleanup = field(repr=False)


async def prepare(
    repo: SnapshotStore,
    layers: LayerStore,
    image: GuestImage,
    ref: str,
    *,
    name: str,
    workdir: Path,
    slot: Slot,
    disk_size_mb: int | None = None,
) -> Prepared:
    """Everything of a restore that does not need the state: the part a warm pool does ahead
    of time. On failure nothing it made is left."""
    snap = await asyncio.to_thread(repo.get, ref)
    if not snap.memory:
        raise RestoreFailed(f"snapshot {ref!r} holds no memory: sandboxes boot from it")
    check_compatible(
        f"snapshot {snap.names[0] if snap.names else snap.id[:12]}",
        image,
        accel=snap.accel,
        qemu_version=snap.qemu_version,
        tools_image=snap.tools_image,
        device_set=snap.device_set,
    )
    upper = workdir / ROOTFS
    prep: Prepared | None = None
    stack = Cleanup(name)

    def holder() -> str:
        # `rename` gives a prepared guest another name: its references move with it.
        return name if prep is None else prep.name

    def upper_now() -> Path:
        return upper if prep is None else prep.upper

    def hold_and_make_upper() -> None:
        # One thread hop for the workdir, both references and the upper (each was one).
        workdir.mkdir(0o700, True, True)
        repo.ref(snap.id, name)
        layers.ref(snap.top_layer, name)
        create_upper_sync(layers.path(snap.top_layer), upper, disk_size_mb)

    stack.push("references", lambda: asyncio.to_thread(_unref, holder(), repo, layers))
    stack.push("upper", lambda: asyncio.to_thread(upper_now().unlink, True))
    try:
        # Whole: a cancel must not return before a reference its thread still takes, or
        # the stack would run first and the reference would outlive it.
        await thread_whole(hold_and_make_upper)
        vm = new_vm(
            image,
            name=name,
            workdir=workdir,
            vcpus=snap.vcpus,
            memory_mb=snap.memory_mb,
            mem_file=repo.memory_path(snap.id),
            shared=False,
            upper=upper,
            tools_image=Path(snap.tools_image),
            slot=slot,
            incoming=True,
            balloon=snap.balloon,
        )
        stack.push("vm", vm.kill)
        await vm.start()
    except BaseException:
        await _run(stack)
        raise
    prep = Prepared(snap, name, workdir, slot, upper, vm, stack)
    return prep


def _unref(holder: str, repo: SnapshotStore, layers: LayerStore) -> None:
    layers.unref_holder(holder)
    repo.unref_holder(holder)


async def _run(stack: Cleanup) -> None:
    """A failed restore's undo; what of it fails is logged (the restore's error is the one
    the caller sees)."""
    with contextlib.suppress(CleanupFailed):
        await stack.run()


async def rename(prep: Prepared, name: str, repo: SnapshotStore, layers: LayerStore) -> None:
    """A prepared guest becomes the sandbox `name` (before `relocate` moves its workdir):
    its references are taken under the new name before the old ones are dropped, so the
    snapshot and layer are held throughout."""
    old = prep.name

    def move() -> None:
        # One thread hop for all of it (the VM's rename writes its record and cgroup too);
        # whole, so a cancel cannot leave `prep.name` behind the references.
        repo.ref(prep.snap.id, name)
        layers.ref(prep.snap.top_layer, name)
        prep.vm.rename(name)
        prep.name = name
        repo.unref(prep.snap.id, old)
        layers.unref(prep.snap.top_layer, old)

    await thread_whole(move)


async def relocate(prep: Prepared, workdir: Path) -> None:
    """Move a prepared guest's workdir (a warm pool entry becoming a sandbox) while its QEMU
    waits; `workdir` must not exist and be on the same filesystem.

    QEMU keeps the name it opened a disk by and may open it again: inactivating the disks at
    the end of a RAM stream after a seal failed with EPERM once the old name was gone
    (measured, QEMU 7.2). So the old name stays, as a symlink to the new place, for as long
    as this QEMU runs; the caller removes it (`unlink_relocated`)."""
    old = prep.workdir
    await asyncio.to_thread(os.rename, old, workdir)
    try:
        await asyncio.to_thread(old.symlink_to, workdir, True)
    except BaseException:
        await asyncio.to_thread(os.rename, workdir, old)
        raise
    prep.vm.relocate(workdir)
    prep.upper = workdir / prep.upper.relative_to(old)
    prep.workdir = workdir


def unlink_relocated(old_workdir: Path) -> None:
    """Remove the symlink `relocate` left (once the QEMU that needed it is gone)."""
    if old_workdir.is_symlink():
        old_workdir.unlink()


async def load(
    prep: Prepared,
    repo: SnapshotStore,
    layers: LayerStore,
    *,
    health_timeout_s: float = RESTORE_HEALTH_TIMEOUT_S,
    envd: EnvdClient | None = None,
) -> Machine:
    """Load the state into a prepared guest; returns once envd answers (through `envd`,
    the caller's client to the slot's envd, if given). On failure the guest is discarded."""
    snap, name, vm = prep.snap, prep.name, prep.vm
    try:
        try:
            await vm.snapshot_load(repo.state_path(snap.id))
        except VMMError as exc:
            raise RestoreFailed(f"{name}: loading snapshot {snap.id[:12]} failed: {exc}") from exc
        machine = Machine(
            name=name,
            workdir=prep.workdir,
            vcpus=snap.vcpus,
            memory_mb=snap.memory_mb,
            slot=prep.slot,
            vm=vm,
            memory=MemoryMode.SNAPSHOT,
            tools_image=Path(snap.tools_image),
            balloon=snap.balloon,
            snapshot_id=snap.id,
        )
        await wait_envd(machine.envd_url, vm, health_timeout_s, envd=envd)
    except BaseException:
        await discard(prep, repo, layers)
        raise
    return machine


async def discard(prep: Prepared, repo: SnapshotStore, layers: LayerStore) -> None:
    """Undo `prepare` (not the workdir or slot, which belong to the caller): its stack."""
    await _run(prep.cleanup)


async def restore(
    repo: SnapshotStore,
    layers: LayerStore,
    image: GuestImage,
    ref: str,
    *,
    name: str,
    workdir: Path,
    slot: Slot,
    disk_size_mb: int | None = None,
    health_timeout_s: float = RESTORE_HEALTH_TIMEOUT_S,
    envd: EnvdClient | None = None,
) -> Machine:
    """Returns once envd answers through `slot` (asked through `envd`, if given). The
    caller gives the guest its identity (`identify`). On failure nothing it made is left
    (QEMU, upper, references)."""
    t0 = time.monotonic()
    prep = await prepare(
        repo, layers, image, ref, name=name, workdir=workdir, slot=slot, disk_size_mb=disk_size_mb
    )
    machine = await load(prep, repo, layers, health_timeout_s=health_timeout_s, envd=envd)
    log.info("%s restored from %s in %.3fs", name, prep.snap.id[:12], time.monotonic() - t0)
    return machine


async def release(machine: Machine, repo: SnapshotStore, layers: LayerStore) -> None:
    """Stop the guest and drop what it holds in the repository and layer store (not its
    workdir or slot, which belong to the caller)."""
    await machine.vm.kill()
    await asyncio.to_thread(repo.unref_holder, machine.name)
    await asyncio.to_thread(layers.unref_holder, machine.name)
