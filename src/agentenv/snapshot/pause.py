"""Pause and resume one sandbox: its QEMU exits and frees RAM and CPU, everything needed to
bring it back stays in its workdir (so a paused sandbox survives a server restart).

A paused sandbox keeps its disk upper in place (no other guest shares it, so sealing it
would only lengthen its chain). Its RAM is saved the cheapest way its memory mode allows:

- `MemoryMode.OWN`: device state only (~10 ms); the memory file stays where it is, and the
  resumed QEMU maps it shared again, so every later pause/resume cycle is as cheap.
- `MemoryMode.SNAPSHOT` (created from a template): a full migration stream. Resume loads it
  into a memory file of the sandbox's own, which turns the sandbox into `OWN` mode.
  `convert_stream` does that load ahead of time, while the sandbox is paused (a converter
  QEMU with no network loads the stream into the memory file and saves device state over
  it), so the resume after it is as cheap as any later one. Until the record says "state"
  the stream is the truth: a conversion cut short leaves only `*.cv` files, removed by the
  next attempt or by a resume.

A filesystem-only pause (`pause_disk`, E2B's `memory: false`) keeps only the disk: the guest's
page cache is synced through envd, QMP `stop` flushes QEMU's block layer (`guestsync`), the
record (kind "disk") is written and QEMU ends; the memory file goes. Its resume cold-boots
over the kept upper (`machine.boot`): files stay, processes do not. A resume that asks for no
memory (`resume(..., memory=False)`) first turns a memory pause into a disk one (record
first, then the RAM files), so from there on nothing can load that RAM over a disk a booted
guest has changed.

Crash safety: a disk pause writes its record while the stopped QEMU still exists (a crash
before it leaves a running sandbox to adopt, after it a paused one). A cold-boot resume
keeps the record until envd answers and only then removes it: a crash while the guest boots
leaves it paused over a disk that is as after a power cut (journal recovery at the next
boot), a crash after it a running sandbox.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from agentenv.faults import crash_point
from agentenv.files import MEMORY, PAUSED, SandboxFiles
from agentenv.network import Slot
from agentenv.snapshot.errors import RestoreFailed, ResumedButLost, SnapshotError
from agentenv.snapshot.guestsync import GuestSyncFailed, guest_sync
from agentenv.snapshot.machine import (
    RESTORE_HEALTH_TIMEOUT_S,
    GuestImage,
    Machine,
    MemoryMode,
    boot,
    new_vm,
    stream_to_memory_file,
    wait_envd,
)
from agentenv.snapshot.repository import SnapshotStore
from agentenv.snapshot.restore import check_compatible
from agentenv.vmm.errors import VMMError
from agentenv.vmm.qemu_argv import DEVICE_SET

STATE = "state"
# A conversion's work in progress (see `convert_stream`).
CONVERT = "convert"
CV_SUFFIX = ".cv"
STREAM = "stream"
# The kind of a filesystem-only pause: no RAM saved, the resume boots.
DISK = "disk"

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PausedState:
    name: str
    vcpus: int
    memory_mb: int
    balloon: bool
    tools_image: str
    accel: str
    qemu_version: str
    # "state": device state over the sandbox's own memory file; "stream": RAM + state;
    # "disk": nothing of the RAM (a filesystem-only pause, resumed by a cold boot).
    kind: str
    upper: str  # file name of the writable disk in the workdir
    paused_at: float
    device_set: str = "1"


def paused_state(workdir: Path) -> PausedState | None:
    """The paused record in `workdir`, or None if the sandbox there is not paused."""
    record = SandboxFiles(workdir).paused
    try:
        raw = json.loads(record.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise SnapshotError(f"{record} is unreadable: {exc}") from exc
    try:
        return PausedState(**raw)
    except TypeError as exc:
        raise SnapshotError(f"{record} is not a paused record: {exc}") from exc


async def pause(machine: Machine, repo: SnapshotStore, image: GuestImage) -> PausedState:
    """Save the guest into its workdir and end its QEMU. The slot is the caller's to release."""
    vm = machine.vm
    workdir = machine.workdir
    kind = "state" if machine.memory is MemoryMode.OWN else "stream"
    target = workdir / (STATE if kind == "state" else STREAM)
    try:
        if kind == "state":
            await vm.snapshot_create(target)
        else:
            await vm.stream_save(target)
    except BaseException as exc:
        await asyncio.to_thread(target.unlink, True)
        if vm.exit_code is None:
            with contextlib.suppress(Exception):
                await vm.resume()
        if isinstance(exc, VMMError):
            raise SnapshotError(f"{machine.name}: pause failed: {exc}") from exc
        raise
    crash_point("pause:saved")
    # The tools disk the guest has mounted: its memory resumes only with that same file.
    record = _record(machine, image, kind, machine.tools_image)
    try:
        await _write_or_run_on(machine, record)
    except BaseException:
        await asyncio.to_thread(target.unlink, True)
        raise
    crash_point("pause:recorded")
    await vm.kill()
    if kind == "stream":
        # The stream holds all of the guest's RAM: it no longer needs the snapshot's file.
        await asyncio.to_thread(repo.unref_holder, machine.name)
    return record


def _record(machine: Machine, image: GuestImage, kind: str, tools_image: Path) -> PausedState:
    return PausedState(
        name=machine.name,
        vcpus=machine.vcpus,
        memory_mb=machine.memory_mb,
        balloon=machine.balloon,
        tools_image=str(tools_image),
        accel=image.accel.name,
        qemu_version=image.qemu_version,
        kind=kind,
        upper=machine.vm.disk_path("vda").name,
        paused_at=time.time(),
        device_set=DEVICE_SET,
    )


async def _write_or_run_on(machine: Machine, record: PausedState) -> None:
    """Write the pause record; if that fails (e.g. a full disk) the guest runs on, as if the
    pause had not been asked for."""
    try:
        await asyncio.to_thread(_write_record, machine.workdir, record)
    except BaseException:
        await asyncio.to_thread((machine.workdir / (PAUSED + ".tmp")).unlink, True)
        if machine.vm.exit_code is None:
            with contextlib.suppress(Exception):
                await machine.vm.resume()
        raise


async def pause_disk(
    machine: Machine,
    repo: SnapshotStore,
    image: GuestImage,
    *,
    envd_token: str | None,
    strict: bool = True,
) -> PausedState:
    """A filesystem-only pause: sync the guest's disk, stop it, record, end its QEMU and drop
    its RAM. `strict`: a guest whose envd cannot sync is not paused (`GuestSyncFailed`, it
    runs on); otherwise it is paused anyway with what its disk holds at the stop."""
    vm = machine.vm
    workdir = machine.workdir
    try:
        await guest_sync(machine.envd_url, envd_token)
    except GuestSyncFailed as exc:
        if strict:
            raise
        log.warning("%s: pausing without a guest sync: %s", machine.name, exc)
    try:
        # Drains and flushes QEMU's block layer (see `guestsync`): the upper is complete.
        await vm.pause()
    except VMMError as exc:
        if vm.exit_code is None:
            with contextlib.suppress(Exception):
                await vm.resume()
        raise SnapshotError(f"{machine.name}: pause failed: {exc}") from exc
    crash_point("fspause:stopped")
    # A cold boot mounts whatever tools disk the host has then.
    record = _record(machine, image, DISK, image.tools_image)
    await _write_or_run_on(machine, record)
    crash_point("fspause:recorded")
    await vm.kill()
    await asyncio.to_thread(drop_memory, workdir)
    # A template clone mapped its snapshot's memory; nothing of this sandbox does now.
    await asyncio.to_thread(repo.unref_holder, machine.name)
    return record


def drop_memory(workdir: Path) -> None:
    """Remove the RAM files of a sandbox whose record no longer needs them (kind "disk")."""
    _clear_conversion(workdir)
    for name in (MEMORY, STATE, STREAM):
        (workdir / name).unlink(missing_ok=True)


def tidy(workdir: Path, repo: SnapshotStore) -> None:
    """What a crash may have left of a disk pause (or of a resume that dropped the memory)
    after its record was written: its RAM files and its hold on a snapshot's memory."""
    record = paused_state(workdir)
    if record is not None and record.kind == DISK:
        drop_memory(workdir)
        repo.unref_holder(record.name)


def _without_memory(workdir: Path, record: PausedState) -> PausedState:
    """Turn a memory pause into a disk pause: the record first, then the RAM it named."""
    disk = PausedState(**{**asdict(record), "kind": DISK})
    _write_record(workdir, disk)
    drop_memory(workdir)
    return disk


def check_paused(record: PausedState, image: GuestImage) -> None:
    """The paused state was written by a QEMU and tools image this node can load."""
    check_compatible(
        f"paused sandbox {record.name}",
        image,
        accel=record.accel,
        qemu_version=record.qemu_version,
        tools_image=record.tools_image,
        device_set=record.device_set,
    )


def _write_record(workdir: Path, record: PausedState) -> None:
    tmp = workdir / (PAUSED + ".tmp")
    tmp.write_text(json.dumps(asdict(record)))
    os.replace(tmp, SandboxFiles(workdir).paused)


def _clear_conversion(workdir: Path) -> None:
    shutil.rmtree(workdir / CONVERT, ignore_errors=True)
    for name in (MEMORY, STATE):
        (workdir / (name + CV_SUFFIX)).unlink(missing_ok=True)


async def convert_stream(workdir: Path, image: GuestImage) -> bool:
    """Turn the RAM stream of the sandbox paused in `workdir` into a memory file of its own
    plus device state. False if there is nothing to convert (not paused, or already state).
    The caller makes sure no resume of this sandbox runs meanwhile: both open its disk."""
    record = await asyncio.to_thread(paused_state, workdir)
    if record is None or record.kind != "stream":
        return False
    check_paused(record, image)
    await asyncio.to_thread(_clear_conversion, workdir)
    memory, state = workdir / (MEMORY + CV_SUFFIX), workdir / (STATE + CV_SUFFIX)
    try:
        await stream_to_memory_file(
            image,
            name=record.name,
            scratch=workdir / CONVERT,
            vcpus=record.vcpus,
            memory_mb=record.memory_mb,
            balloon=record.balloon,
            disk=workdir / record.upper,
            tools_image=Path(record.tools_image),
            stream=workdir / STREAM,
            memory=memory,
            state=state,
        )
        await asyncio.to_thread(os.replace, memory, SandboxFiles(workdir).memory)
        await asyncio.to_thread(os.replace, state, workdir / STATE)
        converted = PausedState(**{**asdict(record), "kind": "state"})
        await asyncio.to_thread(_write_record, workdir, converted)
    except BaseException as exc:
        await asyncio.to_thread(_clear_conversion, workdir)
        if isinstance(exc, VMMError):
            raise SnapshotError(f"{record.name}: converting its RAM stream failed: {exc}") from exc
        raise
    # Off the loop: giving back a stream's blocks takes milliseconds per 100 MB.
    await asyncio.to_thread((workdir / STREAM).unlink, True)
    return True


async def resume(
    workdir: Path,
    image: GuestImage,
    slot: Slot,
    *,
    memory: bool = True,
    health_timeout_s: float = RESTORE_HEALTH_TIMEOUT_S,
) -> Machine:
    """Bring back the sandbox paused in `workdir`, on `slot` (any slot: the guest side of
    every slot is identical). Returns once envd answers; on failure it stays paused.
    `memory=False`, or a filesystem-only pause, cold-boots it over its disk (its saved RAM,
    if any, is dropped first: see the module doc)."""
    record = await asyncio.to_thread(paused_state, workdir)
    if record is None:
        raise RestoreFailed(f"{workdir.name} is not paused")
    if record.kind != DISK and not memory:
        record = await asyncio.to_thread(_without_memory, workdir, record)
    if record.kind == DISK:
        return await _boot(workdir, image, slot, record)
    check_paused(record, image)
    ram = SandboxFiles(workdir).memory
    source = workdir / (STATE if record.kind == "state" else STREAM)
    await asyncio.to_thread(_clear_conversion, workdir)
    if record.kind == "stream":
        # Whatever a failed earlier resume left; the stream refills it completely.
        await asyncio.to_thread(ram.unlink, True)
    vm = new_vm(
        image,
        name=record.name,
        workdir=workdir,
        vcpus=record.vcpus,
        memory_mb=record.memory_mb,
        mem_file=ram,
        shared=True,
        upper=workdir / record.upper,
        tools_image=Path(record.tools_image),
        slot=slot,
        incoming=True,
        balloon=record.balloon,
    )
    machine = Machine(
        name=record.name,
        workdir=workdir,
        vcpus=record.vcpus,
        memory_mb=record.memory_mb,
        slot=slot,
        vm=vm,
        memory=MemoryMode.OWN,
        tools_image=Path(record.tools_image),
        balloon=record.balloon,
    )
    await vm.start()
    try:
        if record.kind == "state":
            await vm.snapshot_load(source, run=False)
        else:
            await vm.stream_load(source, run=False)
        crash_point("resume:loaded")
        # The saved state goes before the guest runs: once it ran, its disk and RAM are
        # newer than the state, and a server that died from here on must find a running
        # sandbox (to adopt), never a paused record that no longer matches its disk.
        await asyncio.to_thread(SandboxFiles(workdir).paused.unlink)
    except BaseException as exc:
        await vm.kill()
        if isinstance(exc, VMMError):
            raise RestoreFailed(f"{record.name}: resume failed: {exc}") from exc
        raise
    try:
        await vm.resume()
        crash_point("resume:running")
        await wait_envd(machine.envd_url, vm, health_timeout_s)
    except BaseException as exc:
        await vm.kill()
        raise ResumedButLost(
            f"{record.name}: the guest ran again but did not answer ({exc}); its paused "
            "state no longer matches its disk"
        ) from exc
    await asyncio.to_thread(source.unlink, True)
    return machine


async def _boot(workdir: Path, image: GuestImage, slot: Slot, record: PausedState) -> Machine:
    """The resume of a disk pause: a cold boot over the kept upper, the record removed only
    once envd answers (see the module doc)."""
    try:
        machine = await boot(
            image,
            name=record.name,
            workdir=workdir,
            vcpus=record.vcpus,
            memory_mb=record.memory_mb,
            upper=workdir / record.upper,
            slot=slot,
            on_spawn=lambda: crash_point("coldboot:booting"),
        )
    except VMMError as exc:
        raise RestoreFailed(f"{record.name}: booting it from its disk failed: {exc}") from exc
    try:
        await asyncio.to_thread(SandboxFiles(workdir).paused.unlink)
    except BaseException:
        await machine.vm.kill()
        raise
    crash_point("coldboot:running")
    return machine
