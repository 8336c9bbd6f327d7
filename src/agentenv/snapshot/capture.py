"""Capturing a guest into a repository snapshot (templates, persistent snapshots, fork).

The guest is stopped, its disk upper sealed (it becomes a read-only layer; a running guest
continues on a new upper over it) and its RAM and device state saved:

- RAM in its own shared file (`MemoryMode.OWN`): device state only (~10 ms); the file moves
  into the snapshot. A guest that keeps running is re-homed: a new QEMU maps the snapshot's
  memory privately and loads the same state (~0.1-0.2 s stop in all).
- RAM privately mapped over another snapshot (`MemoryMode.SNAPSHOT`): a full migration stream
  (~0.4 s for 350 MB written), after which the guest can run again at once. The stream is
  then turned into a plain RAM image by loading it into a converter QEMU whose RAM is a
  shared file and saving that one's device state, so clones of this snapshot map its memory
  copy-on-write like any other. Measured alternatives: `pmemsave` writes ROM shadows and
  every zero page; restoring clones straight from the stream gives them no shared pages.

`capture_disk` is the filesystem-only kind (E2B's `memory: false`): the guest's disk is
synced and the guest stopped only for the seal (`guestsync`); no RAM or device state is
saved, and creates from it cold-boot over its top layer.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from agentenv.faults import crash_point
from agentenv.files import SandboxFiles
from agentenv.guest.envd import ENVD_VERSION
from agentenv.snapshot.errors import CaptureFailed
from agentenv.snapshot.guestsync import guest_sync
from agentenv.snapshot.machine import (
    GuestImage,
    Machine,
    MemoryMode,
    new_vm,
    stream_to_memory_file,
)
from agentenv.snapshot.model import Snapshot
from agentenv.snapshot.repository import MEMORY, STATE, SnapshotStore
from agentenv.storage import LayerStore
from agentenv.vmm.confine import disown
from agentenv.vmm.errors import VMMError
from agentenv.vmm.qemu_argv import DEVICE_SET

log = logging.getLogger(__name__)

STREAM = "stream"


@dataclass(frozen=True)
class Capture:
    snapshot: Snapshot
    # How long the guest was stopped, and the whole capture including hashing.
    stopped_s: float
    total_s: float


async def capture(
    machine: Machine,
    repo: SnapshotStore,
    layers: LayerStore,
    image: GuestImage,
    *,
    keep_running: bool,
    names: Sequence[str] = (),
    source: str = "",
    build_key: str = "",
    holders: Sequence[str] = (),
    envd_token: str | None = None,
) -> Capture:
    """Snapshot `machine`. With `keep_running` the guest runs on afterwards (its open
    connections survive the short stop); otherwise its QEMU is gone when this returns.
    `holders` take a reference on the new snapshot as it is committed."""
    from agentenv.snapshot.repository import check_name

    for n in names:
        check_name(n)
    t0 = time.monotonic()
    vm = machine.vm
    staging = await asyncio.to_thread(repo.stage)
    stopped_s = 0.0
    resumed = False
    try:
        try:
            await vm.pause()
            sealed = await vm.seal_disk("vda", SandboxFiles(machine.workdir).next_upper())
            crash_point("capture:sealed")
            if machine.memory is MemoryMode.OWN:
                await vm.snapshot_create(staging / STATE)
                await vm.kill()
                await asyncio.to_thread(os.rename, machine.memory_file, staging / MEMORY)
                # The guest's QEMU made it (as its own uid); the repository's files are root's.
                await asyncio.to_thread(disown, staging / MEMORY)
                if keep_running:
                    await _rehome(machine, image, staging)
                    resumed = True
            else:
                await vm.stream_save(staging / STREAM)
                if keep_running:
                    await vm.resume()
                    resumed = True
                else:
                    await vm.kill()
            stopped_s = time.monotonic() - t0
            if machine.memory is MemoryMode.SNAPSHOT and not (staging / MEMORY).exists():
                await _convert_stream(machine, image, staging, sealed)
        except VMMError as exc:
            raise CaptureFailed(f"{machine.name}: capture failed: {exc}") from exc
        # The re-homed guest maps the snapshot's memory from the moment it exists.
        rehomed = [machine.name] if keep_running and machine.memory is MemoryMode.OWN else []
        draft = await _draft(machine, image, layers, sealed, names, machine.tools_image)
        draft = replace(
            draft,
            parent=machine.snapshot_id,
            source=source or machine.name,
            build_key=build_key,
            holders=[*holders, *rehomed],
            envd_token=envd_token,
        )
        snap = await asyncio.to_thread(repo.commit, staging, draft)
    except BaseException:
        if keep_running and not resumed and vm.exit_code is None:
            with contextlib.suppress(Exception):
                await vm.resume()
        if resumed and machine.memory is MemoryMode.OWN:
            # Re-homed before the failure: its RAM is now a private mapping of the staged
            # file (which goes, still mapped), so only a full RAM stream can save it.
            machine.memory = MemoryMode.SNAPSHOT
            machine.snapshot_id = None
        await asyncio.to_thread(repo.discard, staging)
        raise
    if rehomed:
        machine.memory = MemoryMode.SNAPSHOT
        machine.snapshot_id = snap.id
    total = time.monotonic() - t0
    log.info(
        "captured %s as %s: stopped %.3fs, total %.3fs",
        machine.name,
        snap.id[:12],
        stopped_s,
        total,
    )
    return Capture(snap, stopped_s, total)


async def _draft(
    machine: Machine,
    image: GuestImage,
    layers: LayerStore,
    sealed: Path,
    names: Sequence[str],
    tools_image: Path,
) -> Snapshot:
    """The snapshot record of a capture whose disk was sealed into `sealed` (added to the
    layer store here); the caller fills in what its kind of capture adds."""
    digest = await asyncio.to_thread(layers.add, sealed)
    chain = await asyncio.to_thread(layers.chain, digest)
    return Snapshot(
        id="",
        layers=list(reversed(chain)),
        vcpus=machine.vcpus,
        memory_mb=machine.memory_mb,
        balloon=machine.balloon,
        tools_image=str(tools_image),
        accel=image.accel.name,
        qemu_version=image.qemu_version,
        device_set=DEVICE_SET,
        envd_version=ENVD_VERSION,
        memory_bytes=0,
        state_bytes=0,
        names=list(names),
    )


async def capture_disk(
    machine: Machine,
    repo: SnapshotStore,
    layers: LayerStore,
    image: GuestImage,
    *,
    names: Sequence[str] = (),
    envd_token: str | None = None,
) -> Capture:
    """A filesystem-only snapshot of a running guest, which keeps running on a new upper.
    `envd_token` is the guest's envd token (for the sync); raises `GuestSyncFailed` while
    envd does not answer, the guest untouched."""
    from agentenv.snapshot.repository import check_name

    for n in names:
        check_name(n)
    t0 = time.monotonic()
    await guest_sync(machine.envd_url, envd_token)
    vm = machine.vm
    staging = await asyncio.to_thread(repo.stage)
    try:
        try:
            # `stop` flushes QEMU's block layer, so the sealed file is complete.
            await vm.pause()
            try:
                sealed = await vm.seal_disk("vda", SandboxFiles(machine.workdir).next_upper())
            finally:
                if vm.exit_code is None:
                    await vm.resume()
        except VMMError as exc:
            raise CaptureFailed(f"{machine.name}: capture failed: {exc}") from exc
        stopped_s = time.monotonic() - t0
        # Creates from it cold-boot with whatever tools disk the host has then.
        draft = await _draft(machine, image, layers, sealed, names, image.tools_image)
        draft = replace(draft, source=machine.name, memory=False)
        snap = await asyncio.to_thread(repo.commit, staging, draft)
    except BaseException:
        await asyncio.to_thread(repo.discard, staging)
        raise
    total = time.monotonic() - t0
    log.info("captured the disk of %s as %s in %.3fs", machine.name, snap.id[:12], total)
    return Capture(snap, stopped_s, total)


async def _rehome(machine: Machine, image: GuestImage, staging: Path) -> None:
    """Run the guest on again from the state just saved, its RAM now a private mapping of
    the (future) snapshot's memory file, on the new upper."""
    upper = machine.vm.disk_path("vda")
    vm = new_vm(
        image,
        name=machine.name,
        workdir=machine.workdir,
        vcpus=machine.vcpus,
        memory_mb=machine.memory_mb,
        mem_file=staging / MEMORY,
        shared=False,
        upper=upper,
        tools_image=machine.tools_image,
        slot=machine.slot,
        incoming=True,
        balloon=machine.balloon,
    )
    await vm.start()
    try:
        await vm.snapshot_load(staging / STATE)
    except BaseException:
        await vm.kill()
        raise
    machine.vm = vm


async def _convert_stream(machine: Machine, image: GuestImage, staging: Path, disk: Path) -> None:
    """The stream in `staging` becomes `staging/memory` + `staging/state`, like any capture."""
    try:
        await stream_to_memory_file(
            image,
            name=machine.name,
            scratch=staging / "convert",
            vcpus=machine.vcpus,
            memory_mb=machine.memory_mb,
            balloon=machine.balloon,
            disk=disk,
            tools_image=machine.tools_image,
            stream=staging / STREAM,
            memory=staging / MEMORY,
            state=staging / STATE,
        )
    finally:
        await asyncio.to_thread((staging / STREAM).unlink, True)
