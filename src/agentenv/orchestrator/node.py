"""A single host's sandboxes: `create` starts one and returns when envd answers, `delete` frees
everything it held (VM, cgroup, slot, upper layer, layer and snapshot references).

With snapshots on (the default), create = resume: the template's snapshot (built once by a cold
boot, `snapshot.templates`) is restored with private copy-on-write RAM and the guest gets its
identity through envd `/init`; nobody boots a kernel, also not for a disk larger than the
template's (the restored guest's disk and ext4 are grown online). A cold boot remains the
fallback when the template snapshot cannot be built. `pause`/`resume`, `snapshot` and `fork`
use `snapshot/`; a paused sandbox lives only in its workdir, so it survives a restart of the
node. Warm pool entries (`orchestrator.warm`) live in `settings.warm_dir` until a create takes
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
import secrets
import shutil
import string
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from agentenv import snapshot as snaps
from agentenv.config import ENVD_PORT, Settings
from agentenv.guest.envd.client import EnvdClient, EnvdError
from agentenv.network import Slot, SlotPool
from agentenv.orchestrator.conversions import PausedConversions
from agentenv.orchestrator.memory import HostMemory, MemoryManager, MemoryPolicy, host_memory
from agentenv.orchestrator.node_errors import (
    BootFailed,
    CpuOutOfRange,
    DiskTooSmallForTemplate,
    MemoryOutOfRange,
    NotPausable,
    SandboxError,
    SandboxNotPaused,
    SandboxPaused,
    UnknownSandbox,
    UnknownTemplate,
)
from agentenv.orchestrator.warm import Shape, WarmPool
from agentenv.snapshot import GuestImage, Machine, MemoryMode, Snapshot, SnapshotError
from agentenv.snapshot.fork import MAX_CHILDREN, ForkTarget
from agentenv.snapshot.pause import PAUSED
from agentenv.snapshot.restore import (
    Prepared,
    discard,
    load,
    prepare,
    relocate,
    unlink_relocated,
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
from agentenv.vmm.accel import AccelChoice, detect
from agentenv.vmm.base import BootSource, Drive, MachineSpec, NetIface
from agentenv.vmm.errors import VMMError
from agentenv.vmm.qemu import QemuVM

log = logging.getLogger(__name__)

_ID_ALPHABET = string.ascii_lowercase + string.digits
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


def new_sandbox_id() -> str:
    return "i" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(19))


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
    # "restore" (from the template snapshot or a named snapshot), "warm" (the same, from a
    # pre-spawned QEMU of the warm pool), "boot" (cold) or "fork".
    origin: str = "boot"

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
        self.pool = SlotPool(settings.network, settings.slot_pool_low, settings.slot_pool_high)
        self._sandboxes: dict[str, SandboxHandle] = {}
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
        # Balloons of idle sandboxes (orchestrator.memory); captures hold it off a sandbox.
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
        )
        self.settings.sandboxes_dir.mkdir(parents=True, exist_ok=True)
        if self.warm.enabled:
            self._warm_root = await asyncio.to_thread(_warm_root, self.settings.warm_dir)
        await self.pool.start()
        self.memory.start()
        self.warm.start()
        # Streams an earlier node paused and did not get to convert.
        for sandbox_id, workdir in await asyncio.to_thread(self._unconverted_pauses):
            self.conversions.start(sandbox_id, workdir)

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

    def _paused_on_disk(self, sandbox_id: str) -> bool:
        if "/" in sandbox_id or sandbox_id in ("", ".", ".."):
            return False
        return (self.settings.sandboxes_dir / sandbox_id / PAUSED).is_file()

    # -- create / delete --------------------------------------------------------------------

    def _validate(
        self, template: str, cpu: int, memory_mb: int, disk_size_mb: int | None
    ) -> tuple[str, Path, int, int]:
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
        return top, top_path, disk_size_mb or base_mb, base_mb

    async def create(
        self,
        template: str = "base",
        cpu: int = 1,
        memory_mb: int = 512,
        disk_size_mb: int | None = None,
    ) -> SandboxHandle:
        if self._boot is None or self._accel is None:
            raise SandboxError("node is not started")
        named = await asyncio.to_thread(self._named_snapshot, template)
        if named is not None:
            return await self._create_from_snapshot(named, template)
        top, top_path, disk_mb, base_mb = await asyncio.to_thread(
            self._validate, template, cpu, memory_mb, disk_size_mb
        )
        snap = None
        if self.snapshots:
            snap = await self._template_snapshot(template, cpu, memory_mb)
        t0 = time.monotonic()
        warm: Prepared | None = None
        if snap is not None:
            warm = self.warm.take(Shape(template, cpu, memory_mb), snap.id)
        sandbox_id = warm.name if warm is not None else new_sandbox_id()
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
                # From here on it is an ordinary sandbox, in the sandboxes dir.
                await relocate(prep, workdir)

            await asyncio.to_thread(self.layers.ref, top, sandbox_id)
            undo.append(lambda: asyncio.to_thread(self.layers.unref, top, sandbox_id))

            if warm is None:
                slot = await self.pool.acquire()
                undo.append(lambda: self.pool.release(slot))

            upper = workdir / ROOTFS
            await self._write_meta(workdir, template, cpu, memory_mb, disk_mb, top)
            if snap is not None:
                handle = await self._restore(
                    snap.id, sandbox_id, template, workdir, slot, top, prepared=warm
                )
                undo.append(lambda: self._release(handle))
                if disk_mb > base_mb:
                    await self._grow_disk(handle, disk_mb)
                handle.boot_s = time.monotonic() - t0
                self._sandboxes[sandbox_id] = handle
                log.info("sandbox %s restored in %.2fs at %s", sandbox_id, handle.boot_s, slot)
                return handle
            try:
                await create_upper(top_path, upper, disk_mb if disk_size_mb is not None else None)
            except DiskTooSmall as exc:
                raise DiskTooSmallForTemplate(str(exc)) from exc

            vm = QemuVM(
                name=sandbox_id,
                workdir=workdir,
                machine=MachineSpec(
                    vcpus=cpu,
                    memory_mb=memory_mb,
                    mem_file=workdir / "memory" if self.mem_file else None,
                ),
                boot=BootSource(
                    self._boot.kernel, self._boot.initrd, self._boot.cmdline(sandbox_id)
                ),
                drives=[
                    Drive("vda", upper, read_only=False, fmt="qcow2"),
                    Drive("vdb", self._boot.tools_image, read_only=True, fmt="raw"),
                ],
                accel=self._accel,
                net=NetIface(slot.tap, slot.guest_mac),
                netns=slot.netns,
                qemu_binary=self.settings.qemu_binary,
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
        deadline = time.monotonic() + self.settings.boot_timeout_s
        url = f"{sb.envd_url}/health"
        last = "no answer"
        async with httpx.AsyncClient(timeout=HEALTH_REQUEST_TIMEOUT_S, trust_env=False) as client:
            while time.monotonic() < deadline:
                if sb.vm.exit_code is not None:
                    raise BootFailed(
                        f"sandbox {sb.id}: VM exited with {sb.vm.exit_code} during boot: "
                        f"{_tail(sb.serial_log)}"
                    )
                try:
                    resp = await client.get(url)
                    if resp.status_code < 300:
                        return
                    last = f"HTTP {resp.status_code}"
                except httpx.TransportError as exc:
                    last = type(exc).__name__
                await asyncio.sleep(HEALTH_POLL_S)
        raise BootFailed(
            f"sandbox {sb.id}: envd not healthy after {self.settings.boot_timeout_s:.0f}s "
            f"({last}); console: {_tail(sb.serial_log)}"
        )

    async def delete(self, sandbox_id: str) -> None:
        sb = self._sandboxes.pop(sandbox_id, None)
        self.memory.forget(sandbox_id)
        await self.conversions.cancel(sandbox_id)
        if sb is None:
            if not self._paused_on_disk(sandbox_id):
                raise UnknownSandbox(f"sandbox {sandbox_id!r} does not exist")
            workdir = self.settings.sandboxes_dir / sandbox_id
        else:
            workdir = sb.workdir
        try:
            if sb is not None and not sb.paused:
                await sb.vm.kill()
                await self._drop_warm_link(sandbox_id)
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
        self, workdir: Path, template: str, cpu: int, memory_mb: int, disk_mb: int, top: str
    ) -> None:
        meta = {
            "template": template,
            "cpu": cpu,
            "memory_mb": memory_mb,
            "disk_size_mb": disk_mb,
            "top_layer": top,
        }
        await asyncio.to_thread((workdir / META).write_text, json.dumps(meta))

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
    ) -> SandboxHandle:
        """Restore `ref` as `sandbox_id` (into `prepared`, a warm pool's guest spawned for
        it, if given) and give it its hostname; cleans up after itself."""
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
            # The caller (the control plane) sets the sandbox's own token next.
            await snaps.identify(
                machine.envd_url,
                hostname=sandbox_id,
                current_token=token,
                access_token="" if token else None,
            )
        except BaseException:
            await self._release(handle)
            raise
        handle.spawn_to_healthy_s = time.monotonic() - t0
        return handle

    async def _grow_disk(self, handle: SandboxHandle, disk_mb: int) -> None:
        """A restored guest has the template's disk: grow the virtual disk under it, then
        its ext4 online, before anyone uses the sandbox."""
        size = disk_mb * 1024 * 1024
        t0 = time.monotonic()
        try:
            await handle.vm.resize_disk("vda", size)
            async with EnvdClient(handle.envd_url) as envd:
                res = await envd.run(
                    GROW_FS.format(sectors=size // 512),
                    user="root",
                    timeout=GROW_TIMEOUT_S,
                    shell="/bin/sh",
                )
        except (VMMError, EnvdError, httpx.HTTPError) as exc:
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

    async def _drop_warm_link(self, sandbox_id: str) -> None:
        """The old name of a sandbox that came from the warm pool (`relocate`), once its
        QEMU is gone."""
        if self._warm_root is not None:
            await asyncio.to_thread(unlink_relocated, self._warm_root / sandbox_id)

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

    async def _create_from_snapshot(self, snap: Snapshot, ref: str) -> SandboxHandle:
        sandbox_id = new_sandbox_id()
        workdir = self.settings.sandboxes_dir / sandbox_id
        t0 = time.monotonic()
        await asyncio.to_thread(workdir.mkdir, 0o700, False, False)
        slot: Slot | None = None
        try:
            slot = await self.pool.acquire()
            await self._write_meta(workdir, ref, snap.vcpus, snap.memory_mb, 0, snap.top_layer)
            handle = await self._restore(snap.id, sandbox_id, ref, workdir, slot, snap.top_layer)
        except BaseException:
            if slot is not None:
                await self.pool.release(slot)
            await asyncio.to_thread(shutil.rmtree, workdir, True)
            raise
        handle.boot_s = time.monotonic() - t0
        self._sandboxes[sandbox_id] = handle
        return handle

    def _machine(self, sandbox_id: str) -> tuple[SandboxHandle, Machine]:
        sb = self.get(sandbox_id)
        if sb.paused:
            raise SandboxPaused(f"sandbox {sandbox_id} is paused")
        if sb.machine is None:
            raise NotPausable(f"sandbox {sandbox_id} was started without snapshot support")
        return sb, sb.machine

    async def pause(self, sandbox_id: str) -> None:
        """Save the sandbox into its workdir; its QEMU exits and its slot is released."""
        sb, machine = self._machine(sandbox_id)
        try:
            async with self.memory.hold(sandbox_id):
                record = await snaps.pause(machine, self.repo, self.image)
        except SnapshotError as exc:
            raise SandboxError(str(exc)) from exc
        sb.paused = True
        if record.kind == "stream":
            self.conversions.start(sandbox_id, machine.workdir)
        await self._drop_warm_link(sandbox_id)
        await self.pool.release(sb.slot)
        # A paused sandbox no longer maps the snapshot it came from; it may have been the
        # last holder of a deleted one.
        await asyncio.to_thread(self.repo.gc)

    async def resume(self, sandbox_id: str) -> SandboxHandle:
        """Bring a paused sandbox back on a free slot (also one paused by an earlier node)."""
        sb = self._sandboxes.get(sandbox_id)
        if sb is not None and not sb.paused:
            raise SandboxNotPaused(f"sandbox {sandbox_id} is running")
        if sb is None and not self._paused_on_disk(sandbox_id):
            raise UnknownSandbox(f"sandbox {sandbox_id!r} does not exist")
        workdir = self.settings.sandboxes_dir / sandbox_id
        t0 = time.monotonic()
        await self.conversions.settle(sandbox_id)
        slot = await self.pool.acquire()
        try:
            machine = await snaps.resume(workdir, self.image, slot)
        except BaseException:
            await self.pool.release(slot)
            raise
        if sb is None:
            meta = json.loads(await asyncio.to_thread((workdir / META).read_text))
            sb = self._handle(machine, meta["template"], meta["top_layer"])
            self._sandboxes[sandbox_id] = sb
        sb.machine, sb.vm, sb.slot, sb.upper, sb.paused = (
            machine,
            machine.vm,
            slot,
            machine.upper,
            False,
        )
        sb.spawn_to_healthy_s = sb.boot_s = time.monotonic() - t0
        return sb

    async def snapshot(
        self, sandbox_id: str, name: str | None = None, envd_token: str | None = None
    ) -> Snapshot:
        """A persistent snapshot of a running sandbox (which keeps running); other sandboxes
        start from it by name. Unnamed ones get a generated name."""
        sb, machine = self._machine(sandbox_id)
        label = name or f"snapshot-{secrets.token_hex(6)}"
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
        self, sandbox_id: str, count: int, envd_token: str | None = None
    ) -> builtins.list[SandboxHandle]:
        """`count` new sandboxes from one capture of a running sandbox, which keeps running."""
        sb, machine = self._machine(sandbox_id)
        if not 1 <= count <= MAX_CHILDREN:
            raise SandboxError(f"fork count must be between 1 and {MAX_CHILDREN}, got {count}")
        targets: list[ForkTarget] = []
        try:
            for _ in range(count):
                child_id = new_sandbox_id()
                workdir = self.settings.sandboxes_dir / child_id
                await asyncio.to_thread(workdir.mkdir, 0o700, False, False)
                targets.append(ForkTarget(child_id, workdir, await self.pool.acquire()))
            async with self.memory.hold(sandbox_id):
                res = await snaps.fork(
                    machine, targets, self.repo, self.layers, self.image, envd_token=envd_token
                )
        except BaseException:
            for t in targets:
                await self.pool.release(t.slot)
                await asyncio.to_thread(shutil.rmtree, t.workdir, True)
            raise
        sb.vm, sb.upper = machine.vm, machine.upper
        handles = []
        for child in res.children:
            top = res.capture.snapshot.top_layer
            await self._write_meta(child.workdir, sb.template, sb.cpu, sb.memory_mb, 0, top)
            h = self._handle(child, sb.template, top)
            h.origin = "fork"
            self._sandboxes[child.name] = h
            handles.append(h)
        return handles


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


def _tail(path: Path, lines: int = 3) -> str:
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return "(no console output)"
    return " | ".join(text[-lines:]) if text else "(no console output)"
