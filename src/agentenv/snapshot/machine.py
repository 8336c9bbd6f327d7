"""A guest that can be captured: its QEMU process, slot, writable disk and where its RAM is.

RAM lives in one of two places, and that decides how a capture saves it:

- `MemoryMode.OWN`: a memory file of the machine's own, mapped shared (``<workdir>/memory``).
  The file *is* the RAM, so a capture writes only device state (~10 ms). Cold-booted template
  builders and resumed sandboxes run like this.
- `MemoryMode.SNAPSHOT`: a private copy-on-write mapping of a repository snapshot's memory
  file (never written; every clone shares its page cache). A capture must save the RAM the
  guest holds privately: a full migration stream.
"""

from __future__ import annotations

import asyncio
import enum
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from agentenv.config import Settings
from agentenv.files import SandboxFiles
from agentenv.guest.envd.client import EnvdClient, EnvdError
from agentenv.network import Slot
from agentenv.ports import ENVD_PORT
from agentenv.snapshot.errors import RestoreFailed
from agentenv.vmm.accel import AccelChoice, boot_deadline, detect
from agentenv.vmm.base import BootSource, DiskLimits, Drive, MachineSpec, NetIface
from agentenv.vmm.confine import disown
from agentenv.vmm.qemu import QemuVM
from agentenv.vmm.ramshim import ensure_ram_shim
from agentenv.vmm.version import qemu_version as binary_version

HEALTH_POLL_S = 0.02
RESTORE_HEALTH_TIMEOUT_S = 30.0


class MemoryMode(enum.Enum):
    OWN = "own"
    SNAPSHOT = "snapshot"


@dataclass(frozen=True)
class GuestImage:
    """What this host launches guests with (resolved once; cache hits do no work)."""

    kernel: Path
    initrd: Path | None
    tools_image: Path
    accel: AccelChoice
    qemu_binary: str
    # hostname → kernel command line; only cold boots use it.
    cmdline: Callable[[str], str]
    # Preloaded into QEMUs whose RAM is a private mapping of a snapshot (`vmm.ramshim`).
    ram_shim: Path
    # Seconds a cold boot may take until envd answers (`vmm.accel.boot_deadline`).
    boot_timeout_s: float
    # Where every QEMU keeps its record while it runs (`vmm.registry`), and who hears of one
    # that ended on its own.
    vm_registry: Path | None = None
    on_vm_exit: Callable[[QemuVM], None] | None = None
    # Confined QEMUs (`vmm.confine`; Settings.confine).
    confine: bool = True
    # Host IO each guest's writable disk may use (Settings.disk_bps_mb / disk_iops).
    disk_limits: DiskLimits | None = None

    @classmethod
    def resolve(cls, settings: Settings) -> GuestImage:
        from agentenv.template import artifacts

        arts = artifacts.ensure_all(settings, None)
        accel = detect(settings)
        deadline = boot_deadline(settings, accel)

        def cmdline(hostname: str) -> str:
            extra = artifacts.guest_args(settings, hostname=hostname, boot_timeout_s=deadline)
            return artifacts.kernel_cmdline(arts, accel.name, extra)

        shim = ensure_ram_shim(settings.cache)
        return cls(
            arts.kernel,
            arts.initramfs,
            arts.tools_image,
            accel,
            settings.qemu_binary,
            cmdline,
            shim,
            deadline,
            settings.vms_dir,
            confine=settings.confine,
            disk_limits=disk_limits(settings),
        )

    @property
    def qemu_version(self) -> str:
        return qemu_version(self.qemu_binary)


def disk_limits(settings: Settings) -> DiskLimits | None:
    return DiskLimits.of(settings.disk_bps_mb, settings.disk_iops)


def qemu_version(binary: str) -> str:
    """`major.minor.patch` of a QEMU binary: device state only loads into the same version."""
    return str(binary_version(binary))


@dataclass
class Machine:
    name: str
    workdir: Path
    vcpus: int
    memory_mb: int
    slot: Slot
    vm: QemuVM
    memory: MemoryMode
    # The tools disk the guest has mounted (it must stay the same file across restores).
    tools_image: Path
    balloon: bool = True
    # MemoryMode.SNAPSHOT: the snapshot whose memory file backs this guest's RAM.
    snapshot_id: str | None = None

    @property
    def upper(self) -> Path:
        """The file that takes the guest's disk writes now."""
        return self.vm.disk_path("vda")

    @property
    def memory_file(self) -> Path:
        return SandboxFiles(self.workdir).memory

    @property
    def envd_url(self) -> str:
        return envd_url(self.slot)


def envd_url(slot: Slot) -> str:
    """Where the envd of the guest in `slot` answers."""
    return f"http://{slot.slot_ip}:{ENVD_PORT}"


def new_vm(
    image: GuestImage,
    *,
    name: str,
    workdir: Path,
    vcpus: int,
    memory_mb: int,
    mem_file: Path | None,
    shared: bool,
    upper: Path,
    tools_image: Path,
    slot: Slot | None,
    incoming: bool,
    hostname: str = "",
    balloon: bool = True,
    upper_read_only: bool = False,
) -> QemuVM:
    """The one way a guest's QEMU is built (sandboxes, warm entries, template builders,
    converters): the device set must be identical between the VM that saves a state and
    every VM that loads it, and every guest gets the image's limits. `slot=None` gives the
    NIC a throwaway tap (for a VM that only converts a snapshot); `mem_file=None` keeps RAM
    anonymous (a node without snapshots)."""
    from agentenv.config import DEFAULT_GUEST_MAC

    net = (
        NetIface(slot.tap, slot.guest_mac)
        if slot is not None
        else NetIface("tap0", DEFAULT_GUEST_MAC, detached=True)
    )
    return QemuVM(
        name=name,
        workdir=workdir,
        machine=MachineSpec(
            vcpus=vcpus, memory_mb=memory_mb, mem_file=mem_file, mem_shared=shared, balloon=balloon
        ),
        boot=BootSource(image.kernel, image.initrd, image.cmdline(hostname or name)),
        drives=[
            Drive("vda", upper, read_only=upper_read_only, fmt="qcow2"),
            Drive("vdb", tools_image, read_only=True, fmt="raw"),
        ],
        accel=image.accel,
        net=net,
        netns=None if slot is None else slot.netns,
        qemu_binary=image.qemu_binary,
        incoming=incoming,
        ram_shim=image.ram_shim,
        registry=image.vm_registry,
        on_exit=image.on_vm_exit,
        confine=image.confine,
        disk_limits=image.disk_limits,
    )


async def boot(
    image: GuestImage,
    *,
    name: str,
    workdir: Path,
    vcpus: int,
    memory_mb: int,
    upper: Path,
    slot: Slot,
    on_spawn: Callable[[], None] | None = None,
    hostname: str = "",
) -> Machine:
    """Cold-boot a guest over the disk `upper` (a filesystem-only resume, a create from a
    filesystem-only snapshot, a template build): a fresh kernel with `hostname` (else
    `name`), RAM in a new shared `<workdir>/memory` (`MemoryMode.OWN`, so a later pause
    writes device state only), the current tools layer. Returns once envd answers; on
    failure (`RestoreFailed` once the image's `boot_timeout_s` passed without an answer) its
    QEMU is gone. `on_spawn` runs once QEMU runs, before the guest is up."""
    mem = SandboxFiles(workdir).memory
    # Whatever RAM image was there belongs to a guest that no longer exists.
    await asyncio.to_thread(mem.unlink, True)
    vm = new_vm(
        image,
        name=name,
        workdir=workdir,
        vcpus=vcpus,
        memory_mb=memory_mb,
        mem_file=mem,
        shared=True,
        upper=upper,
        tools_image=image.tools_image,
        slot=slot,
        incoming=False,
        hostname=hostname,
    )
    machine = Machine(
        name=name,
        workdir=workdir,
        vcpus=vcpus,
        memory_mb=memory_mb,
        slot=slot,
        vm=vm,
        memory=MemoryMode.OWN,
        tools_image=image.tools_image,
    )
    await vm.start()
    try:
        if on_spawn is not None:
            on_spawn()
        await wait_envd(machine.envd_url, vm, image.boot_timeout_s, poll_s=0.1)
    except BaseException:
        await vm.kill()
        raise
    return machine


async def stream_to_memory_file(
    image: GuestImage,
    *,
    name: str,
    scratch: Path,
    vcpus: int,
    memory_mb: int,
    balloon: bool,
    disk: Path,
    tools_image: Path,
    stream: Path,
    memory: Path,
    state: Path,
) -> None:
    """Load a RAM stream into a converter QEMU (no network, `disk` read-only) whose RAM is the
    shared file `memory`, and save its device state to `state`: a plain RAM image plus state,
    as a capture of a guest with a memory file of its own makes. The converter and `scratch`
    (its workdir) are gone when this returns."""
    helper = new_vm(
        image,
        name=f"{name}-cv",
        workdir=scratch,
        vcpus=vcpus,
        memory_mb=memory_mb,
        mem_file=memory,
        shared=True,
        upper=disk,
        upper_read_only=True,
        tools_image=tools_image,
        slot=None,
        incoming=True,
        balloon=balloon,
    )
    try:
        await helper.start()
        await helper.stream_load(stream, run=False)
        await helper.snapshot_create(state)
        # Written by the converter's uid; from here on the server's.
        await asyncio.to_thread(disown, memory)
    finally:
        await helper.kill()
        await asyncio.to_thread(shutil.rmtree, scratch, True)


async def wait_envd(
    url: str,
    vm: QemuVM,
    timeout_s: float,
    poll_s: float = HEALTH_POLL_S,
    *,
    envd: EnvdClient | None = None,
) -> None:
    """Until envd answers `/health` through the slot; fails early if QEMU exits. With
    `envd` (the caller's client to that guest) its connection stays open for the next
    request: a restore's `/init` then needs no new connection (a guest-side accept, under
    TCG a few ms of guest CPU, and a client of the server's)."""

    def exited() -> str | None:
        return None if vm.exit_code is None else f"QEMU exited with {vm.exit_code}"

    try:
        if envd is not None:
            await envd.wait_healthy(timeout_s, poll_s, gone=exited)
            return
        async with EnvdClient(url, timeout=2.0) as own:
            await own.wait_healthy(timeout_s, poll_s, gone=exited)
    except EnvdError as exc:
        raise RestoreFailed(f"{vm.name}: {exc.message}") from exc
