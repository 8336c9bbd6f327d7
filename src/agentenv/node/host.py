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
import fcntl
import json
import logging
import os
import secrets
import shutil
import signal
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agentenv import snapshot as snaps
from agentenv.aio import thread_whole
from agentenv.config import ENVD_PORT, Settings
from agentenv.contract.ids import is_sandbox_id, new_sandbox_id
from agentenv.contract.runtime import HostMemory
from agentenv.faults import crash_point
from agentenv.guest.envd.client import EnvdClient, EnvdError
from agentenv.network import OPEN, Egress, Slot, SlotPool, recover_slots, slot_for
from agentenv.network.dns import DnsForwarder
from agentenv.network.slot import NETNS_PREFIX
from agentenv.node.admission import Admission, Limits
from agentenv.node.conversions import PausedConversions
from agentenv.node.errors import (
    BootFailed,
    CpuOutOfRange,
    DiskTooSmallForTemplate,
    InvalidResources,
    MemoryOutOfRange,
    NotPausable,
    SandboxError,
    SandboxNotPaused,
    SandboxPaused,
    UnknownSandbox,
    UnknownTemplate,
)
from agentenv.node.memory import MemoryManager, MemoryPolicy, host_memory
from agentenv.node.warm import Shape, WarmPool
from agentenv.snapshot import GuestImage, Machine, MemoryMode, Snapshot, SnapshotError
from agentenv.snapshot.fork import MAX_CHILDREN, ForkTarget
from agentenv.snapshot.identity import ENTROPY_BYTES
from agentenv.snapshot.machine import disk_limits, new_vm, wait_envd
from agentenv.snapshot.pause import DISK, PAUSED, STATE, STREAM, tidy
from agentenv.snapshot.restore import (
    Prepared,
    discard,
    load,
    prepare,
    relocate,
    unlink_relocated,
)
from agentenv.snapshot.restore import (
    rename as rename_prepared,
)
from agentenv.storage import (
    DiskTooSmall,
    LayerInUse,
    LayerNotFound,
    LayerStore,
    StorageError,
    create_upper,
    info,
)
from agentenv.template.catalog import Template
from agentenv.vmm import registry as vm_registry
from agentenv.vmm.accel import AccelChoice, detect
from agentenv.vmm.base import VMStatus
from agentenv.vmm.cgroup import Cgroup
from agentenv.vmm.errors import VMMError
from agentenv.vmm.qemu import QemuVM, remove_socket

log = logging.getLogger(__name__)

HEALTH_POLL_S = 0.1
HEALTH_REQUEST_TIMEOUT_S = 2.0
ROOTFS = "rootfs.qcow2"
# What a paused sandbox needs besides `snapshot.pause`'s record to come back as a handle.
META = "sandbox.json"
# Growing a restored guest's ext4 after its disk grew: wait (bounded) until the kernel has
# taken the new capacity from the config-change interrupt, then resize2fs on the mounted
# root, both from the tools layer so it works whatever the rootfs has. `{sectors}` is
# filled in. Needs a /bin/sh in the rootfs (envd runs commands through a login shell).
_TOOLS = "/.agentenv"
GROW_FS = (
    f"B={_TOOLS}/bin/busybox; i=0; "
    'while [ "$($B cat /sys/class/block/vda/size)" -lt {sectors} ]; do '
    "i=$((i+1)); if [ $i -gt 200 ]; then "
    'echo "the guest kernel still sees $($B cat /sys/class/block/vda/size) sectors" >&2; '
    "exit 1; fi; $B sleep 0.05; done; "
    f"exec {_TOOLS}/python/lib/ld-linux-x86-64.so.2 --library-path {_TOOLS}/python/lib "
    f"{_TOOLS}/python/bin/resize2fs /dev/vda"
)
GROW_TIMEOUT_S = 120.0
# An adopted guest's envd answers at once unless the guest is broken.
ADOPT_HEALTH_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class TemplateDefaults:
    """What a template sets for commands in its sandboxes (an image's Env, User, WorkingDir;
    `template.catalog.Template`); empty for `base`, whose defaults are envd's."""

    env: dict[str, str] = field(default_factory=dict)
    user: str | None = None
    workdir: str | None = None

    @classmethod
    def of(cls, tpl: Template) -> TemplateDefaults:
        return cls(dict(tpl.env), tpl.user, tpl.workdir)

    @property
    def any(self) -> bool:
        return bool(self.env) or self.user is not None or self.workdir is not None


@dataclass(frozen=True)
class GuestInit:
    """What the caller gives a new guest in its one envd `/init`, on top of the template's
    defaults: env vars for every command and the access token envd requires from then on."""

    env_vars: Mapping[str, str] = field(default_factory=dict)
    envd_token: str | None = None

    def env_over(self, defaults: TemplateDefaults | None) -> dict[str, str]:
        """The template's env with the caller's on top (the caller's value wins)."""
        return {**(defaults.env if defaults is not None else {}), **self.env_vars}


NO_INIT = GuestInit()


@dataclass
class SandboxHandle:
    id: str
    template: str
    cpu: int
    memory_mb: int
    disk_size_mb: int
    slot: Slot
    workdir: Path
    upper: Path
    top_layer: str
    vm: QemuVM = field(repr=False)
    # create() call → healthy, and VMM process spawn → healthy.
    boot_s: float = 0.0
    spawn_to_healthy_s: float = 0.0
    # Set when the sandbox can be captured (snapshots on); `vm` is always `machine.vm`.
    machine: Machine | None = field(default=None, repr=False)
    paused: bool = False
    # Where the guest may open connections (`network.egress`, set on its slot).
    egress: Egress = OPEN
    # "restore" (from the template snapshot or a named snapshot), "warm" (the same, from a
    # pre-spawned QEMU of the warm pool), "boot" (cold), "fork", or "adopted" (left running
    # by a server that died, taken over by this one).
    origin: str = "boot"
    # Its last start was a cold boot over its disk (a filesystem-only resume): its envd was
    # fresh and got the full `/init` of a create.
    booted: bool = False
    # The token its envd requires (the node's own calls into the guest send it).
    envd_token: str | None = field(default=None, repr=False)
    # Taken from the warm pool: the entry's old workdir, left as a symlink to the new one
    # while its QEMU runs (`relocate`); under the entry's name, not the sandbox's.
    warm_link: Path | None = field(default=None, repr=False)

    @property
    def address(self) -> str:
        """Host-side address that forwards every guest port."""
        return str(self.slot.slot_ip)

    @property
    def envd_url(self) -> str:
        return f"http://{self.address}:{ENVD_PORT}"

    @property
    def serial_log(self) -> Path:
        return self.vm.serial_log

    @property
    def pid(self) -> int | None:
        return self.vm.pid


@dataclass(frozen=True)
class _Boot:
    """What every VM of this node boots from, resolved once at `start()`."""

    kernel: Path
    initrd: Path | None
    tools_image: Path
    cmdline: Callable[[str], str]


class Node:
    def __init__(
        self, settings: Settings, *, mem_file: bool = False, snapshots: bool | None = None
    ) -> None:
        self.settings = settings
        self.snapshots = settings.snapshots if snapshots is None else snapshots
        # Snapshots need guest RAM in a file (pause saves only device state over it).
        self.mem_file = mem_file or self.snapshots
        self.layers = LayerStore(settings.layers_dir)
        self.repo = snaps.SnapshotRepository(settings.home / "snapshots", self.layers)
        self.pool = SlotPool(
            settings.network,
            settings.slot_pool_low,
            settings.slot_pool_high,
            owner=settings.slots_dir,
            # The resolver guests are given (the slot gateway) forwards to these.
            dns=DnsForwarder(settings.dns),
        )
        self._sandboxes: dict[str, SandboxHandle] = {}
        # Sandboxes found dead or not adoptable at start: why (the control plane takes each
        # once, `NodeRuntime.lost_reason`).
        self.lost: dict[str, str] = {}
        # Told (sandbox id, why) the moment a running sandbox's VM ends on its own; without
        # a handler the node deletes the sandbox itself.
        self.on_lost: Callable[[str, str], None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        # Held while this node runs: the node that gets it owns what a dead one left.
        self._owner_fd: int | None = None
        # Every start (create, resume, fork) is admitted first: capacity, then a FIFO turn.
        self.admission = Admission(
            Limits.from_settings(settings),
            lambda: [sb for sb in self._sandboxes.values() if not sb.paused],
            settings.home,
        )
        self.warm = WarmPool(
            settings.warm_low if self.snapshots else 0,
            settings.warm_high if self.snapshots else 0,
            self._warm_make,
            self._warm_drop,
            self._warm_current,
        )
        # This node's warm entries (`<warm_dir>/<pid>-<random>/<sandbox id>`), made at start.
        self._warm_root: Path | None = None
        self._accel: AccelChoice | None = None
        self._layer_mb: dict[str, int] = {}
        self._boot: _Boot | None = None
        self._image: GuestImage | None = None
        # Balloons of idle sandboxes (node.memory); captures hold it off a sandbox.
        # Paused sandboxes' RAM streams become memory files of their own in the background.
        self.conversions = PausedConversions(lambda: self.image)
        self.memory = MemoryManager(
            self.list,
            MemoryPolicy(
                idle_s=settings.idle_reclaim_s,
                floor_mb=settings.balloon_floor_mb,
                pressure_pct=settings.memory_pressure_pct,
            ),
        )

    @property
    def accel(self) -> AccelChoice:
        if self._accel is None:
            raise SandboxError("node is not started")
        return self._accel

    async def start(self) -> None:
        """Detect the accelerator, resolve the guest artifacts and fill the slot pool."""
        from agentenv.template import artifacts
        from agentenv.vmm.ramshim import ensure_ram_shim

        self._accel = detect(self.settings)
        for warning in self._accel.warnings:
            log.warning("%s", warning)
        arts = await asyncio.to_thread(artifacts.ensure_all, self.settings, None)
        shim = await asyncio.to_thread(ensure_ram_shim, self.settings.cache)
        accel_name = self._accel.name

        def cmdline(sandbox_id: str) -> str:
            extra = artifacts.guest_args(self.settings, hostname=sandbox_id)
            return artifacts.kernel_cmdline(arts, accel_name, extra)

        self._boot = _Boot(arts.kernel, arts.initramfs, arts.tools_image, cmdline)
        self._image = GuestImage(
            arts.kernel,
            arts.initramfs,
            arts.tools_image,
            self._accel,
            self.settings.qemu_binary,
            cmdline,
            shim,
            self.settings.vms_dir,
            self._vm_exited,
            confine=self.settings.confine,
            disk_limits=disk_limits(self.settings),
        )
        self.settings.sandboxes_dir.mkdir(parents=True, exist_ok=True)
        self._owner_fd = await asyncio.to_thread(_claim_data_dir, self.settings.run_dir)
        if self._owner_fd is not None:
            await self._recover()
        else:
            # Another live node holds this data dir: what runs there is its own.
            log.info("another node runs on %s: no crash recovery", self.settings.home)
        if self.warm.enabled:
            self._warm_root = await asyncio.to_thread(_warm_root, self.settings.warm_dir)
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
        their slots, cgroups, files and references. A sandbox dir that neither runs nor is
        paused is lost: removed, and the reason kept in `lost`."""
        s = self.settings
        keep: set[int] = set()
        for rec in await asyncio.to_thread(vm_registry.load_all, s.vms_dir):
            pid = await asyncio.to_thread(vm_registry.live_pid, rec)
            workdir = Path(rec.workdir)
            is_sandbox = workdir.parent == s.sandboxes_dir and workdir.name == rec.name
            if pid is not None and is_sandbox and not self._paused_on_disk(rec.name):
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
            await self._reap(rec, pid, keep_workdir=is_sandbox)
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
            await asyncio.to_thread(shutil.rmtree, workdir, True)
        removed = await recover_slots(s.network, s.slots_dir, keep)
        if removed:
            log.info("removed %d network slot(s) a previous server left", len(removed))
        await asyncio.to_thread(self._release_orphan_holders)

    async def _reap(
        self, rec: vm_registry.VMRecord, pid: int | None, *, keep_workdir: bool
    ) -> None:
        """End a QEMU of an earlier server that nobody adopts and remove what it had."""
        if pid is not None:
            log.info("ending %s (pid %d) left by a previous server", rec.name, pid)
            with contextlib.suppress(ProcessLookupError):
                fd = os.pidfd_open(pid)
                try:
                    os.kill(pid, signal.SIGKILL)
                    await _wait_readable(fd, 10.0)
                finally:
                    os.close(fd)
        if rec.spec.get("cgroup"):
            with contextlib.suppress(Exception):
                await asyncio.to_thread(Cgroup(rec.name).remove)
        await asyncio.to_thread(remove_socket, Path(rec.qmp_socket))
        workdir = Path(rec.workdir)
        if not keep_workdir and workdir.is_relative_to(self.settings.home):
            await asyncio.to_thread(shutil.rmtree, workdir, True)
        await asyncio.to_thread(vm_registry.remove, self.settings.vms_dir, rec.name)

    async def _adopt(self, rec: vm_registry.VMRecord, pid: int) -> SandboxHandle:
        """Take over a sandbox's QEMU that a dead server started. An operation it was in the
        middle of is rolled forward: a guest stopped for a pause or capture runs on; one
        that never got its state (a restore cut short) cannot be adopted."""
        workdir = Path(rec.workdir)
        meta = json.loads(await asyncio.to_thread((workdir / META).read_text))
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
            slot = slot_for(self.settings.network, int(vm.netns[len(NETNS_PREFIX) :]))
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
        for holder in filter(orphan, self.repo.all_holders()):
            self.repo.unref_holder(holder)

    def _vm_exited(self, vm: QemuVM) -> None:
        """A QEMU ended without being asked to (crashed, killed from outside). Called by
        its watcher at once; the sandbox it ran is lost, a warm entry is replaced."""
        sb = self._sandboxes.get(vm.name)
        if sb is not None and sb.vm is vm and not sb.paused:
            why = f"its VM ended unexpectedly (exit status {vm.exit_code}): {_tail(vm.serial_log)}"
            if self.on_lost is not None:
                self.on_lost(sb.id, why)
            else:
                self._background(self.delete(sb.id), f"delete-lost-{sb.id}")
            return
        self.warm.evict(vm.name)

    def _background(self, coro: Awaitable[None], name: str) -> None:
        async def run() -> None:
            try:
                await coro
            except Exception:
                log.exception("%s failed", name)

        task = asyncio.create_task(run(), name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

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

    @property
    def image(self) -> GuestImage:
        if self._image is None:
            raise SandboxError("node is not started")
        return self._image

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

    def get(self, sandbox_id: str) -> SandboxHandle:
        try:
            return self._sandboxes[sandbox_id]
        except KeyError:
            raise UnknownSandbox(f"sandbox {sandbox_id!r} does not exist") from None

    def running(self, sandbox_id: str) -> SandboxHandle | None:
        """The handle of a sandbox that runs here (not paused), else None."""
        sb = self._sandboxes.get(sandbox_id)
        return None if sb is None or sb.paused else sb

    def list(self) -> list[SandboxHandle]:
        return list(self._sandboxes.values())

    def is_alive(self, sandbox_id: str) -> bool:
        """Running here, or paused (in memory or on disk from an earlier node)."""
        sb = self._sandboxes.get(sandbox_id)
        if sb is not None and not sb.paused:
            return sb.vm.pid is not None and sb.vm.exit_code is None
        return self._paused_on_disk(sandbox_id)

    def host_memory(self, sandbox_id: str) -> HostMemory | None:
        """What the sandbox's QEMU holds on the host (PSS), None unless it runs."""
        sb = self._sandboxes.get(sandbox_id)
        pid = None if sb is None or sb.paused else sb.vm.pid
        return None if pid is None else host_memory(pid)

    def paused_memory(self, sandbox_id: str) -> bool | None:
        """Whether a paused sandbox kept its memory (False: a filesystem-only pause, no RAM
        file on disk, resumed by a cold boot); None unless it is paused."""
        if self.running(sandbox_id) is not None or not self._paused_on_disk(sandbox_id):
            return None
        try:
            record = snaps.paused_state(self.settings.sandboxes_dir / sandbox_id)
        except SnapshotError:
            return None
        return None if record is None else record.kind != DISK

    def _on_disk(self, sandbox_id: str, what: str = "") -> bool:
        if "/" in sandbox_id or sandbox_id in ("", ".", ".."):
            return False
        return (self.settings.sandboxes_dir / sandbox_id / what).exists()

    def _paused_on_disk(self, sandbox_id: str) -> bool:
        return self._on_disk(sandbox_id, PAUSED)

    def sandbox_ids(self) -> builtins.list[str]:
        """Every sandbox this node holds: running ones and those paused on disk."""
        ids = {sb.id for sb in self._sandboxes.values() if not sb.paused}
        if self.settings.sandboxes_dir.is_dir():
            ids |= {p.name for p in self.settings.sandboxes_dir.iterdir() if (p / PAUSED).is_file()}
        return sorted(ids)

    # -- create / delete --------------------------------------------------------------------

    def _validate(
        self, template: str, cpu: int, memory_mb: int, disk_size_mb: int | None
    ) -> tuple[str, Path, int, int, TemplateDefaults]:
        s = self.settings
        if not 1 <= cpu <= s.max_cpu:
            raise CpuOutOfRange(f"cpu must be between 1 and {s.max_cpu}, got {cpu}")
        if memory_mb < s.min_memory_mb:
            raise MemoryOutOfRange(
                f"memory {memory_mb} MB is below the guest minimum of {s.min_memory_mb} MB"
            )
        if memory_mb > s.max_memory_mb:
            raise MemoryOutOfRange(f"memory {memory_mb} MB is above the {s.max_memory_mb} MB limit")
        from agentenv.template.catalog import TemplateCatalog, TemplateNotFound

        try:
            tpl = TemplateCatalog(s).get(template)
        except TemplateNotFound as exc:
            raise UnknownTemplate(f"template {template!r} does not exist") from exc
        if not tpl.layers:
            raise UnknownTemplate(f"template {template!r} has no layers")
        top = tpl.layers[-1]
        top_path = self.layers.path(top)
        base_mb = self._layer_mb.get(top)
        if base_mb is None:
            # Layers are content-addressed and immutable: one `qemu-img info` per layer, not
            # one per create.
            base_mb = self._layer_mb[top] = -(-info(top_path).virtual_size // (1024 * 1024))
        if disk_size_mb is not None and disk_size_mb < base_mb:
            raise DiskTooSmallForTemplate(
                f"disk of {disk_size_mb} MB is smaller than template {template!r} ({base_mb} MB)"
            )
        return top, top_path, disk_size_mb or base_mb, base_mb, TemplateDefaults.of(tpl)

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
    ) -> SandboxHandle:
        """`egress` (`network.egress`: internet off, destinations allowed or denied) holds
        from before the guest first runs, on every resume and in its fork children. The
        sandbox runs as `sandbox_id` (a new id if None); its envd gets one `/init` with its
        hostname, clock, entropy, the template's defaults and `init`. `metadata` is kept
        with it."""
        if self._boot is None or self._accel is None:
            raise SandboxError("node is not started")
        if sandbox_id is not None:
            await asyncio.to_thread(self._check_new_id, sandbox_id)
        named = await asyncio.to_thread(self._named_snapshot, template)
        if named is not None:
            return await self._create_from_snapshot(
                named, template, egress, sandbox_id, init, metadata
            )
        top, top_path, disk_mb, base_mb, defaults = await asyncio.to_thread(
            self._validate, template, cpu, memory_mb, disk_size_mb
        )
        async with self.admission.start(f"a create of {template!r}", memory_mb):
            return await self._create(
                template, cpu, memory_mb, disk_size_mb, top, top_path, disk_mb, base_mb, egress,
                defaults, sandbox_id, init, metadata,
            )  # fmt: skip

    def _check_new_id(self, sandbox_id: str) -> None:
        """An id the caller chose: a DNS label of ours, not held by anything here."""
        if not is_sandbox_id(sandbox_id):
            raise InvalidResources(
                f"sandbox id {sandbox_id!r} is not 'i' and 19 lowercase letters or digits"
            )
        if sandbox_id in self._sandboxes or (self.settings.sandboxes_dir / sandbox_id).exists():
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
        sandbox_id = given_id or (warm.name if warm is not None else new_sandbox_id())
        workdir = self.settings.sandboxes_dir / sandbox_id
        undo: list[Callable[[], Awaitable[None]]] = []
        try:
            if warm is None:
                await asyncio.to_thread(workdir.mkdir, 0o700, False, False)
            undo.append(lambda: asyncio.to_thread(shutil.rmtree, workdir, True))
            if warm is not None:
                prep = warm
                slot = prep.slot
                warm_workdir = prep.workdir
                undo.append(lambda: self.pool.release(prep.slot))
                undo.append(lambda: discard(prep, self.repo, self.layers))
                undo.append(lambda: asyncio.to_thread(shutil.rmtree, warm_workdir, True))
                undo.append(lambda: asyncio.to_thread(unlink_relocated, warm_workdir))
                if prep.name != sandbox_id:
                    # The entry was made before anyone knew the id; it takes the caller's.
                    await rename_prepared(prep, sandbox_id, self.repo, self.layers)
                # From here on it is an ordinary sandbox, in the sandboxes dir.
                await relocate(prep, workdir)
                crash_point("create:relocated")

            await thread_whole(self.layers.ref, top, sandbox_id)
            undo.append(lambda: asyncio.to_thread(self.layers.unref, top, sandbox_id))

            if warm is None:
                slot = await self.pool.acquire()
                undo.append(lambda: self.pool.release(slot))
            if not egress.open:
                # Before the guest runs (a warm entry's QEMU waits for its state).
                await self.pool.set_egress(slot, egress)

            upper = workdir / ROOTFS
            await self._write_meta(
                workdir, template, cpu, memory_mb, disk_mb, top, egress, defaults, metadata
            )
            if snap is not None:
                handle = await self._restore(
                    snap.id, sandbox_id, template, workdir, slot, top, prepared=warm,
                    defaults=defaults, init=init,
                )  # fmt: skip
                handle.egress = egress
                if warm is not None:
                    handle.warm_link = warm_workdir
                undo.append(lambda: self._release(handle))
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
                mem_file=workdir / "memory" if self.mem_file else None,
                shared=True,
                upper=upper,
                tools_image=self._boot.tools_image,
                slot=slot,
                incoming=False,
            )
            await vm.start()
            undo.append(vm.kill)

            handle = SandboxHandle(
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
            )
            if self.snapshots:
                handle.machine = Machine(
                    name=sandbox_id,
                    workdir=workdir,
                    vcpus=cpu,
                    memory_mb=memory_mb,
                    slot=slot,
                    vm=vm,
                    memory=MemoryMode.OWN,
                    tools_image=self._boot.tools_image,
                )
            await self._wait_healthy(handle)
            await self._init_booted(handle, defaults, init)
            now = time.monotonic()
            handle.boot_s = now - t0
            handle.spawn_to_healthy_s = now - (vm.started_at or t0)
        except BaseException:
            # The sandbox dir (and its console log) is about to go: keep the console in the log.
            console = _tail(workdir / "serial.log", 40)
            log.warning("create of %s failed; console tail: %s", sandbox_id, console)
            for step in reversed(undo):
                try:
                    await step()
                except Exception:
                    log.exception("cleanup after failed create of %s", sandbox_id)
            raise
        self._sandboxes[sandbox_id] = handle
        log.info("sandbox %s up in %.2fs at %s", sandbox_id, handle.boot_s, handle.address)
        return handle

    async def _wait_healthy(self, sb: SandboxHandle) -> None:
        def exited() -> str | None:
            code = sb.vm.exit_code
            return None if code is None else f"VM exited with {code} during boot"

        async with EnvdClient(sb.envd_url, timeout=HEALTH_REQUEST_TIMEOUT_S) as envd:
            try:
                await envd.wait_healthy(
                    self.settings.boot_timeout_s,
                    HEALTH_POLL_S,
                    probe_s=HEALTH_REQUEST_TIMEOUT_S,
                    gone=exited,
                )
            except EnvdError as exc:
                raise BootFailed(
                    f"sandbox {sb.id}: {exc.message}; console: {_tail(sb.serial_log)}"
                ) from exc

    async def delete(self, sandbox_id: str) -> None:
        sb = self._sandboxes.pop(sandbox_id, None)
        self.memory.forget(sandbox_id)
        await self.conversions.cancel(sandbox_id)
        if sb is None:
            # Paused, or what is left of one that was lost while resuming.
            if not self._on_disk(sandbox_id):
                raise UnknownSandbox(f"sandbox {sandbox_id!r} does not exist")
            workdir = self.settings.sandboxes_dir / sandbox_id
        else:
            workdir = sb.workdir
        try:
            if sb is not None and not sb.paused:
                await sb.vm.kill()
                await self._drop_warm_link(sb)
        finally:
            if sb is not None and not sb.paused:
                await self.pool.release(sb.slot)
            held = await asyncio.to_thread(self.layers.held_by, sandbox_id)
            await asyncio.to_thread(self.layers.unref_holder, sandbox_id)
            await asyncio.to_thread(self.repo.unref_holder, sandbox_id)
            await asyncio.to_thread(shutil.rmtree, workdir, True)
        # The snapshot a fork made goes with its last child.
        await asyncio.to_thread(self.repo.gc)
        await asyncio.to_thread(self._remove_unheld_layers, held)

    def _remove_unheld_layers(self, digests: builtins.list[str]) -> None:
        """Layers the deleted sandbox was the last to hold (a fork's top layer once the fork
        snapshot is gone), top down, up to the first one something else still uses. Not a
        store-wide gc: that would race with a capture between adding a layer and committing
        the snapshot that references it."""
        for top in digests:
            try:
                chain = self.layers.chain(top)
            except (LayerNotFound, StorageError):
                continue
            for digest in chain:
                try:
                    self.layers.remove(digest)
                except (LayerInUse, LayerNotFound):
                    break

    # -- snapshots --------------------------------------------------------------------------

    def _named_snapshot(self, ref: str) -> Snapshot | None:
        """A snapshot created through the API (`POST /sandboxes/{id}/snapshots`), by name or
        id; template names win over snapshot names."""
        if not self.snapshots:
            return None
        from agentenv.template.catalog import TemplateCatalog, TemplateNotFound

        try:
            TemplateCatalog(self.settings).get(ref)
            return None
        except TemplateNotFound:
            pass
        try:
            return self.repo.get(ref)
        except SnapshotError:
            return None

    async def _template_snapshot(self, template: str, cpu: int, memory_mb: int) -> Snapshot | None:
        try:
            return await snaps.ensure_template_snapshot(
                self.settings, template, memory_mb, cpu, self.image
            )
        except Exception as exc:
            log.warning("template %s: no snapshot (%s); cold boot instead", template, exc)
            return None

    async def _write_meta(
        self,
        workdir: Path,
        template: str,
        cpu: int,
        memory_mb: int,
        disk_mb: int,
        top: str,
        egress: Egress,
        defaults: TemplateDefaults | None = None,
        metadata: Mapping[str, str] | None = None,
    ) -> None:
        meta: dict[str, object] = {
            "template": template,
            "cpu": cpu,
            "memory_mb": memory_mb,
            "disk_size_mb": disk_mb,
            "top_layer": top,
            "egress": egress.to_json(),
        }
        if defaults is not None and defaults.any:
            # A boot from this disk later (filesystem-only resume) needs them again, also if
            # the template has been replaced or deleted by then.
            meta["defaults"] = {"env": defaults.env, "user": defaults.user,
                                "workdir": defaults.workdir}  # fmt: skip
        if metadata:
            meta["metadata"] = dict(metadata)
        await asyncio.to_thread(_replace_json, workdir / META, meta)

    async def _restore(
        self,
        ref: str,
        sandbox_id: str,
        template: str,
        workdir: Path,
        slot: Slot,
        top: str,
        origin: str = "restore",
        prepared: Prepared | None = None,
        defaults: TemplateDefaults | None = None,
        init: GuestInit = NO_INIT,
    ) -> SandboxHandle:
        """Restore `ref` as `sandbox_id` (into `prepared`, a warm pool's guest spawned for
        it, if given) and give it, in one `/init`, its hostname, the template's defaults and
        `init`; cleans up after itself."""
        t0 = time.monotonic()
        if prepared is not None:
            machine = await load(prepared, self.repo, self.layers)
        else:
            machine = await snaps.restore(
                self.repo, self.layers, self.image, ref, name=sandbox_id, workdir=workdir, slot=slot
            )
        handle = self._handle(machine, template, top)
        handle.origin = "warm" if prepared is not None else origin
        token = (await asyncio.to_thread(self.repo.get, ref)).envd_token
        try:
            d = defaults or TemplateDefaults()
            env = init.env_over(d)
            await snaps.identify(
                machine.envd_url,
                hostname=sandbox_id,
                current_token=token,
                # The captured guest's token (if any) is replaced by the sandbox's own.
                access_token=init.envd_token or ("" if token else None),
                env_vars=env or None,
                default_user=d.user,
                default_workdir=d.workdir,
            )
            handle.envd_token = init.envd_token
        except BaseException:
            await self._release(handle)
            raise
        handle.spawn_to_healthy_s = time.monotonic() - t0
        return handle

    async def _init_booted(
        self, handle: SandboxHandle, defaults: TemplateDefaults | None, init: GuestInit
    ) -> None:
        """A cold-booted guest's envd knows nothing yet (its hostname came on the kernel
        command line): its one `/init` carries the clock, entropy, the template's defaults
        and `init` (a restored guest gets the same with its identity, `_restore`)."""
        d = defaults or TemplateDefaults()
        env = init.env_over(d)
        try:
            # A fresh envd ignores the header; one that has the token (a start cut short
            # after its `/init`, given it again) needs it.
            async with EnvdClient(handle.envd_url, init.envd_token) as envd:
                await envd.init(
                    env_vars=env or None,
                    access_token=init.envd_token,
                    default_user=d.user,
                    default_workdir=d.workdir,
                    entropy=os.urandom(ENTROPY_BYTES),
                )
        except EnvdError as exc:
            raise BootFailed(f"sandbox {handle.id}: envd refused its /init: {exc}") from exc
        handle.envd_token = init.envd_token

    async def init_guest(self, sandbox_id: str, init: GuestInit) -> None:
        """The full `/init` of a create again, for a running sandbox (`Runtime.init_guest`)."""
        sb = self.get(sandbox_id)
        if sb.paused:
            raise SandboxPaused(f"sandbox {sandbox_id} is paused")
        meta = await asyncio.to_thread((sb.workdir / META).read_text)
        await self._init_booted(sb, _defaults_of(json.loads(meta)), init)

    async def guest_metrics(self, sandbox_id: str, envd_token: str | None) -> dict[str, Any] | None:
        """envd's current `/metrics` sample of a running sandbox, None when it cannot say."""
        sb = self._sandboxes.get(sandbox_id)
        if sb is None or sb.paused:
            return None
        try:
            async with EnvdClient(sb.envd_url, envd_token, timeout=5.0) as envd:
                return await envd.metrics()
        except (EnvdError, ValueError) as exc:
            log.info("sandbox %s metrics unavailable: %r", sandbox_id, exc)
            return None

    async def reinit(self, sandbox_id: str) -> None:
        """After a resume with its memory: the guest's clock stood still while it was paused
        and its RNG state is the one it was saved with."""
        sb = self.get(sandbox_id)
        async with EnvdClient(sb.envd_url, sb.envd_token) as envd:
            await envd.init(entropy=os.urandom(ENTROPY_BYTES))

    async def guest_health(self, sandbox_id: str, timeout_s: float) -> str | None:
        """Why the running sandbox's envd does not answer `/health`, None when it does."""
        sb = self._sandboxes.get(sandbox_id)
        if sb is None or sb.paused:
            return "not running"
        async with EnvdClient(sb.envd_url, timeout=timeout_s) as envd:
            return await envd.unhealthy(timeout_s)

    async def update_egress(self, sandbox_id: str, egress: Egress) -> None:
        """Replace a sandbox's egress policy: at once while it runs (on its slot), from its
        next resume while it is paused."""
        sb = self._sandboxes.get(sandbox_id)
        if (sb is None or sb.paused) and not self._paused_on_disk(sandbox_id):
            raise UnknownSandbox(f"sandbox {sandbox_id!r} does not exist")
        workdir = self.settings.sandboxes_dir / sandbox_id
        if sb is not None and not sb.paused:
            await self.pool.set_egress(sb.slot, egress)
            sb.egress = egress

        def rewrite() -> None:
            meta = json.loads((workdir / META).read_text())
            meta["egress"] = egress.to_json()
            _replace_json(workdir / META, meta)

        await asyncio.to_thread(rewrite)

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

    async def _drop_warm_link(self, sb: SandboxHandle) -> None:
        """The old name of a sandbox that came from the warm pool (`relocate`), once its
        QEMU is gone. A sandbox adopted after a restart has no record of it: the old name
        lives in a dead process's warm root, which the next start removes."""
        link, sb.warm_link = sb.warm_link, None
        if link is None and self._warm_root is not None:
            link = self._warm_root / sb.id
        if link is not None:
            await asyncio.to_thread(unlink_relocated, link)

    async def _warm_current(self, shape: Shape) -> str | None:
        from agentenv.template.catalog import TemplateNotFound

        try:
            snap = await asyncio.to_thread(
                snaps.find_template_snapshot,
                self.settings,
                self.image,
                shape.template,
                shape.cpu,
                shape.memory_mb,
            )
        except TemplateNotFound:
            return None
        return None if snap is None else snap.id

    async def _warm_make(self, snapshot_id: str) -> Prepared:
        """A warm pool entry: a new sandbox id with its workdir (outside the sandboxes dir
        until a create takes it), slot and waiting QEMU."""
        if self._warm_root is None:
            raise SandboxError("node is not started")
        sandbox_id = new_sandbox_id()
        workdir = self._warm_root / sandbox_id
        await asyncio.to_thread(workdir.mkdir, 0o700, False, False)
        slot: Slot | None = None
        try:
            slot = await self.pool.acquire()
            return await prepare(
                self.repo,
                self.layers,
                self.image,
                snapshot_id,
                name=sandbox_id,
                workdir=workdir,
                slot=slot,
            )
        except BaseException:
            if slot is not None:
                await self.pool.release(slot)
            await asyncio.to_thread(shutil.rmtree, workdir, True)
            raise

    async def _warm_drop(self, prep: Prepared) -> None:
        try:
            await discard(prep, self.repo, self.layers)
        finally:
            await self.pool.release(prep.slot)
            await asyncio.to_thread(shutil.rmtree, prep.workdir, True)

    def _handle(self, machine: Machine, template: str, top: str) -> SandboxHandle:
        return SandboxHandle(
            id=machine.name,
            template=template,
            cpu=machine.vcpus,
            memory_mb=machine.memory_mb,
            disk_size_mb=-(-info(machine.upper).virtual_size // (1024 * 1024)),
            slot=machine.slot,
            workdir=machine.workdir,
            upper=machine.upper,
            top_layer=top,
            vm=machine.vm,
            machine=machine,
        )

    async def _release(self, handle: SandboxHandle) -> None:
        """Undo of a restore: the VM and its references (the caller owns slot and workdir)."""
        if handle.machine is not None:
            await snaps.release(handle.machine, self.repo, self.layers)

    async def _create_from_snapshot(
        self,
        snap: Snapshot,
        ref: str,
        egress: Egress,
        sandbox_id: str | None = None,
        init: GuestInit = NO_INIT,
        metadata: Mapping[str, str] | None = None,
    ) -> SandboxHandle:
        async with self.admission.start(f"a create from snapshot {ref!r}", snap.memory_mb):
            return await self._from_snapshot(
                snap, ref, egress, sandbox_id or new_sandbox_id(), init, metadata
            )

    async def _from_snapshot(
        self,
        snap: Snapshot,
        ref: str,
        egress: Egress,
        sandbox_id: str,
        init: GuestInit,
        metadata: Mapping[str, str] | None,
    ) -> SandboxHandle:
        workdir = self.settings.sandboxes_dir / sandbox_id
        t0 = time.monotonic()
        await asyncio.to_thread(workdir.mkdir, 0o700, False, False)
        slot: Slot | None = None
        try:
            slot = await self.pool.acquire()
            if not egress.open:
                await self.pool.set_egress(slot, egress)
            await self._write_meta(
                workdir, ref, snap.vcpus, snap.memory_mb, 0, snap.top_layer, egress,
                metadata=metadata,
            )  # fmt: skip
            if snap.memory:
                handle = await self._restore(
                    snap.id, sandbox_id, ref, workdir, slot, snap.top_layer, init=init
                )
            else:
                handle = await self._boot_snapshot(snap, sandbox_id, ref, workdir, slot)
                try:
                    await self._init_booted(handle, None, init)
                except BaseException:
                    await handle.vm.kill()
                    await asyncio.to_thread(self.layers.unref_holder, sandbox_id)
                    raise
            handle.egress = egress
        except BaseException:
            if slot is not None:
                await self.pool.release(slot)
            await asyncio.to_thread(shutil.rmtree, workdir, True)
            raise
        handle.boot_s = time.monotonic() - t0
        self._sandboxes[sandbox_id] = handle
        return handle

    async def _boot_snapshot(
        self, snap: Snapshot, sandbox_id: str, ref: str, workdir: Path, slot: Slot
    ) -> SandboxHandle:
        """A sandbox from a filesystem-only snapshot: a cold boot over a fresh upper on its
        top layer (which the sandbox holds), in the snapshot's shape."""
        t0 = time.monotonic()
        top = snap.top_layer
        machine: Machine | None = None
        try:
            await thread_whole(self.layers.ref, top, sandbox_id)
            upper = workdir / ROOTFS
            await create_upper(await asyncio.to_thread(self.layers.path, top), upper, None)
            machine = await snaps.boot(
                self.image,
                name=sandbox_id,
                workdir=workdir,
                vcpus=snap.vcpus,
                memory_mb=snap.memory_mb,
                upper=upper,
                slot=slot,
                timeout_s=self.settings.boot_timeout_s,
            )
            handle = await asyncio.to_thread(self._handle, machine, ref, top)
        except BaseException as exc:
            if machine is not None:
                await machine.vm.kill()
            await asyncio.to_thread(self.layers.unref_holder, sandbox_id)
            if isinstance(exc, (SnapshotError, VMMError)):
                raise BootFailed(
                    f"sandbox {sandbox_id} from snapshot {ref!r}: {exc}; console: "
                    f"{_tail(workdir / 'serial.log')}"
                ) from exc
            raise
        handle.origin = "boot"
        handle.booted = True
        handle.spawn_to_healthy_s = time.monotonic() - t0
        return handle

    def _machine(self, sandbox_id: str) -> tuple[SandboxHandle, Machine]:
        sb = self.get(sandbox_id)
        if sb.paused:
            raise SandboxPaused(f"sandbox {sandbox_id} is paused")
        if sb.machine is None:
            raise NotPausable(f"sandbox {sandbox_id} was started without snapshot support")
        return sb, sb.machine

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
        await self._drop_warm_link(sb)
        await self.pool.release(sb.slot)
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
                    meta = await asyncio.to_thread((sb.workdir / META).read_text)
                    await self._init_booted(sb, _defaults_of(json.loads(meta)), init)
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
            record = snaps.paused_state(self.settings.sandboxes_dir / sandbox_id)
        if record is None:
            raise UnknownSandbox(f"sandbox {sandbox_id!r} does not exist")
        return record

    async def _resume(self, sandbox_id: str, memory: bool) -> SandboxHandle:
        sb = self._sandboxes.get(sandbox_id)
        if sb is not None and not sb.paused:
            raise SandboxNotPaused(f"sandbox {sandbox_id} is running")
        if sb is None and not self._paused_on_disk(sandbox_id):
            raise UnknownSandbox(f"sandbox {sandbox_id!r} does not exist")
        workdir = self.settings.sandboxes_dir / sandbox_id
        t0 = time.monotonic()
        await self.conversions.settle(sandbox_id)
        meta = json.loads(await asyncio.to_thread((workdir / META).read_text))
        egress = Egress.from_json(meta.get("egress"))
        slot = await self.pool.acquire()
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
                boot_timeout_s=self.settings.boot_timeout_s,
            )
        except BaseException as exc:
            await self.pool.release(slot)
            if isinstance(exc, snaps.ResumedButLost):
                await self.delete(sandbox_id)
            raise
        if sb is None:
            sb = self._handle(machine, meta["template"], meta["top_layer"])
            sb.egress = egress
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
        """`count` new sandboxes from one capture of a running sandbox, which keeps running
        (admitted as `count` starts of its size). `children`: each child's id and what its
        envd's one `/init` carries (its token, env vars); else new ids and no token."""
        sb, _ = self._machine(sandbox_id)
        if children is not None:
            count = len(children)
            for child_id, _init in children:
                await asyncio.to_thread(self._check_new_id, child_id)
        async with self.admission.start(f"a fork of {sandbox_id}", sb.memory_mb, count):
            return await self._fork(sandbox_id, count, envd_token, children)

    async def _fork(
        self,
        sandbox_id: str,
        count: int,
        envd_token: str | None,
        children: Sequence[tuple[str, GuestInit]] | None = None,
    ) -> builtins.list[SandboxHandle]:
        sb, machine = self._machine(sandbox_id)
        if not 1 <= count <= MAX_CHILDREN:
            raise SandboxError(f"fork count must be between 1 and {MAX_CHILDREN}, got {count}")
        named = (
            list(children)
            if children is not None
            else [(new_sandbox_id(), NO_INIT) for _ in range(count)]
        )
        targets: list[ForkTarget] = []
        loop = asyncio.get_running_loop()
        futures: list[asyncio.Future[ForkTarget]] = [loop.create_future() for _ in range(count)]

        async def setup() -> None:
            # One at a time (a slot build takes a host-wide lock, ~60 ms under TCG), while
            # the capture and the first children's restores run.
            try:
                for fut, (child_id, child_init) in zip(futures, named, strict=True):
                    workdir = self.settings.sandboxes_dir / child_id
                    # Synchronous (one mkdir), so that no cancel falls between it and its undo.
                    workdir.mkdir(0o700)
                    try:
                        slot = await self.pool.acquire()
                    except BaseException:
                        await asyncio.to_thread(shutil.rmtree, workdir, True)
                        raise
                    targets.append(
                        ForkTarget(
                            child_id,
                            workdir,
                            slot,
                            access_token=child_init.envd_token,
                            env_vars=child_init.env_vars or None,
                        )
                    )
                    if not sb.egress.open:
                        # The children inherit the source's policy before they run.
                        await self.pool.set_egress(slot, sb.egress)
                    fut.set_result(targets[-1])
            except BaseException as exc:
                err = exc if isinstance(exc, Exception) else SandboxError("fork: setup cancelled")
                for fut in futures:
                    if not fut.done():
                        fut.set_exception(err)
                raise

        setup_task = asyncio.create_task(setup())
        try:
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
            for t in targets:
                await self.pool.release(t.slot)
                await asyncio.to_thread(shutil.rmtree, t.workdir, True)
            raise
        sb.vm, sb.upper = machine.vm, machine.upper
        handles = []
        for child in res.children:
            top = res.capture.snapshot.top_layer
            inherited = await asyncio.to_thread(_meta_defaults, sb.workdir)
            await self._write_meta(
                child.workdir, sb.template, sb.cpu, sb.memory_mb, 0, top, sb.egress, inherited
            )
            h = self._handle(child, sb.template, top)
            h.origin = "fork"
            h.envd_token = dict(named).get(child.name, NO_INIT).envd_token
            h.egress = sb.egress
            self._sandboxes[child.name] = h
            handles.append(h)
        return handles


def _defaults_of(meta: dict[str, object]) -> TemplateDefaults | None:
    """The template defaults a sandbox's ``sandbox.json`` recorded at create, if any."""
    d = meta.get("defaults")
    if not isinstance(d, dict):
        return None
    return TemplateDefaults(dict(d.get("env") or {}), d.get("user"), d.get("workdir"))


def _meta_defaults(workdir: Path) -> TemplateDefaults | None:
    try:
        return _defaults_of(json.loads((workdir / META).read_text()))
    except (OSError, ValueError):
        return None


def _replace_json(path: Path, value: object) -> None:
    """Write `path` whole or not at all (a crash never leaves half a file to recover from)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(value))
    os.replace(tmp, path)


def _claim_data_dir(run_dir: Path) -> int | None:
    """An exclusive lock on `<home>/run/node.lock`, held for the node's life; None if a
    live node (this process's or another's) holds it. The kernel drops it when its holder
    dies, so after a crash the next node gets it and recovers."""
    run_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(run_dir / "node.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def _warm_root(warm_dir: Path) -> Path:
    """A fresh directory for this node's warm entries; those of nodes whose process is gone
    (a crash) are removed, those of live ones (another server on this data dir) kept."""
    warm_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    for old in warm_dir.iterdir():
        pid = old.name.split("-", 1)[0]
        if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            shutil.rmtree(old, ignore_errors=True)
    root = warm_dir / f"{os.getpid()}-{secrets.token_hex(4)}"
    root.mkdir(mode=0o700)
    return root


async def _wait_readable(fd: int, timeout_s: float) -> None:
    """Until a pidfd says its process ended (bounded)."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()

    def readable() -> None:
        if not done.done():
            done.set_result(None)

    loop.add_reader(fd, readable)
    try:
        async with asyncio.timeout(timeout_s):
            await done
    except TimeoutError:
        raise SandboxError(f"a process still runs {timeout_s:.0f}s after SIGKILL") from None
    finally:
        loop.remove_reader(fd)


def _tail(path: Path, lines: int = 3) -> str:
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return "(no console output)"
    return " | ".join(text[-lines:]) if text else "(no console output)"
