"""A single host's sandboxes: `create` boots one and returns when envd answers, `delete` frees
everything it held (VM, cgroup, slot, upper layer, layer reference).

Creation is ordered so that validation happens before any resource exists, and every step
after that has its undo registered; a failure anywhere unwinds in reverse.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import shutil
import string
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from agentenv.config import ENVD_PORT, Settings
from agentenv.network import Slot, SlotPool
from agentenv.orchestrator.node_errors import (
    BootFailed,
    CpuOutOfRange,
    DiskTooSmallForTemplate,
    MemoryOutOfRange,
    SandboxError,
    UnknownSandbox,
    UnknownTemplate,
)
from agentenv.storage import DiskTooSmall, LayerStore, create_upper, info
from agentenv.vmm.accel import AccelChoice, detect
from agentenv.vmm.base import BootSource, Drive, MachineSpec, NetIface
from agentenv.vmm.qemu import QemuVM

log = logging.getLogger(__name__)

_ID_ALPHABET = string.ascii_lowercase + string.digits
HEALTH_POLL_S = 0.1
HEALTH_REQUEST_TIMEOUT_S = 2.0
ROOTFS = "rootfs.qcow2"


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
    def __init__(self, settings: Settings, *, mem_file: bool = False) -> None:
        self.settings = settings
        self.mem_file = mem_file
        self.layers = LayerStore(settings.layers_dir)
        self.pool = SlotPool(settings.network, settings.slot_pool_low, settings.slot_pool_high)
        self._sandboxes: dict[str, SandboxHandle] = {}
        self._accel: AccelChoice | None = None
        self._boot: _Boot | None = None

    @property
    def accel(self) -> AccelChoice:
        if self._accel is None:
            raise SandboxError("node is not started")
        return self._accel

    async def start(self) -> None:
        """Detect the accelerator, resolve the guest artifacts and fill the slot pool."""
        from agentenv.template import artifacts

        self._accel = detect(self.settings)
        for warning in self._accel.warnings:
            log.warning("%s", warning)
        arts = await asyncio.to_thread(artifacts.ensure_all, self.settings, None)
        accel_name = self._accel.name

        def cmdline(sandbox_id: str) -> str:
            extra = artifacts.guest_args(self.settings, hostname=sandbox_id)
            return artifacts.kernel_cmdline(arts, accel_name, extra)

        self._boot = _Boot(arts.kernel, arts.initramfs, arts.tools_image, cmdline)
        self.settings.sandboxes_dir.mkdir(parents=True, exist_ok=True)
        await self.pool.start()

    async def close(self) -> None:
        """Delete every sandbox of this node and release pooled slots."""
        for sandbox_id in list(self._sandboxes):
            with contextlib.suppress(Exception):
                await self.delete(sandbox_id)
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
        sb = self._sandboxes.get(sandbox_id)
        return sb is not None and sb.vm.pid is not None and sb.vm.exit_code is None

    # -- create / delete --------------------------------------------------------------------

    def _validate(
        self, template: str, cpu: int, memory_mb: int, disk_size_mb: int | None
    ) -> tuple[str, Path, int]:
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
        base_mb = -(-info(top_path).virtual_size // (1024 * 1024))
        if disk_size_mb is not None and disk_size_mb < base_mb:
            raise DiskTooSmallForTemplate(
                f"disk of {disk_size_mb} MB is smaller than template {template!r} ({base_mb} MB)"
            )
        return top, top_path, disk_size_mb or base_mb

    async def create(
        self,
        template: str = "base",
        cpu: int = 1,
        memory_mb: int = 512,
        disk_size_mb: int | None = None,
    ) -> SandboxHandle:
        if self._boot is None or self._accel is None:
            raise SandboxError("node is not started")
        top, top_path, disk_mb = await asyncio.to_thread(
            self._validate, template, cpu, memory_mb, disk_size_mb
        )
        t0 = time.monotonic()
        sandbox_id = new_sandbox_id()
        workdir = self.settings.sandboxes_dir / sandbox_id
        undo: list[Callable[[], Awaitable[None]]] = []
        try:
            await asyncio.to_thread(workdir.mkdir, 0o700, False, False)
            undo.append(lambda: asyncio.to_thread(shutil.rmtree, workdir, True))

            await asyncio.to_thread(self.layers.ref, top, sandbox_id)
            undo.append(lambda: asyncio.to_thread(self.layers.unref, top, sandbox_id))

            slot = await self.pool.acquire()
            undo.append(lambda: self.pool.release(slot))

            upper = workdir / ROOTFS
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
        if sb is None:
            raise UnknownSandbox(f"sandbox {sandbox_id!r} does not exist")
        try:
            await sb.vm.kill()
        finally:
            await self.pool.release(sb.slot)
            await asyncio.to_thread(self.layers.unref_holder, sandbox_id)
            await asyncio.to_thread(shutil.rmtree, sb.workdir, True)


def _tail(path: Path, lines: int = 3) -> str:
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return "(no console output)"
    return " | ".join(text[-lines:]) if text else "(no console output)"
