"""QEMU `-M microvm` driver over QMP: one process per guest, in a netns and a cgroup.

`QemuVM` is the driver. This module holds its process lifecycle (start, adopt, stop, kill,
cleanup), run state, renames and the balloon; its other parts are mixins over
`qemu_base.QemuBase`: the command line (`qemu_argv`), the drives (`qemu_disks`) and
migration (`qemu_migration`)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, Self

from agentenv import aio
from agentenv.vmm import confine as vm_confine
from agentenv.vmm import launch as vm_launch
from agentenv.vmm import registry as vm_registry
from agentenv.vmm.accel import AccelChoice
from agentenv.vmm.base import BootSource, DiskLimits, Drive, MachineSpec, NetIface, VMStatus
from agentenv.vmm.cgroup import Limits
from agentenv.vmm.errors import BalloonUnsupported, VMMError, VMStartError
from agentenv.vmm.qemu_argv import QemuArgv, private_ram
from agentenv.vmm.qemu_base import SOCK_FALLBACK_DIR, QuietQMPClient
from agentenv.vmm.qemu_disks import QemuDisks
from agentenv.vmm.qemu_migration import QemuMigration

log = logging.getLogger(__name__)

QMP_CONNECT_TIMEOUT_S = 10.0
# A SIGKILLed process is gone within milliseconds unless the kernel holds it (D state).
KILL_TIMEOUT_S = 30.0
# The exit status of an adopted QEMU (its parent is the dead server's launcher, which reaps
# it: we only see it end), or of one whose launcher did not tell.
EXIT_UNKNOWN = -1
# The launcher reports a status as soon as it reaps the child, milliseconds after its end.
EXIT_STATUS_TIMEOUT_S = 2.0
# QEMU itself (device state, heap, page tables, and up to 64 MiB of TCG code cache) on top of
# the guest's RAM; a larger code cache raises it by the rest (`AccelChoice.code_cache_extra_mb`).
MEMORY_OVERHEAD_MB = 192
PIDS_LIMIT = 256


def remove_socket(path: Path) -> None:
    """A QMP socket, and the directory of its own a confined VM with a long path got."""
    path.unlink(missing_ok=True)
    if path.parent.parent == SOCK_FALLBACK_DIR:
        with contextlib.suppress(OSError):
            path.parent.rmdir()


_STATUS = {
    "running": VMStatus.RUNNING,
    "paused": VMStatus.PAUSED,
    "suspended": VMStatus.PAUSED,
    "postmigrate": VMStatus.PAUSED,
    "finish-migrate": VMStatus.PAUSED,
    "save-vm": VMStatus.PAUSED,
    "restore-vm": VMStatus.PAUSED,
    "inmigrate": VMStatus.CREATED,
    "prelaunch": VMStatus.CREATED,
    "shutdown": VMStatus.STOPPED,
    "guest-panicked": VMStatus.STOPPED,
    "internal-error": VMStatus.STOPPED,
    "io-error": VMStatus.PAUSED,
    "watchdog": VMStatus.PAUSED,
    "debug": VMStatus.PAUSED,
}


def memory_overhead_mb(accel: AccelChoice) -> int:
    return MEMORY_OVERHEAD_MB + accel.code_cache_extra_mb


def cgroup_limits(machine: MachineSpec, accel: AccelChoice) -> Limits:
    return Limits(
        memory_bytes=(machine.memory_mb + memory_overhead_mb(accel)) * 1024 * 1024,
        cpus=float(machine.vcpus),
        pids=PIDS_LIMIT,
    )


class QemuVM(QemuArgv, QemuDisks, QemuMigration):
    """A microvm guest. Every file it makes lives in `workdir` (serial log, QEMU's stderr,
    QMP socket); `kill()`/`stop()` release the process, the cgroup and the socket, also after
    a start that failed half way.

    With a `registry` directory the VM keeps a record there while its process lives
    (`vmm.registry`), so a server that died can be followed by one that finds it again
    (`adopt`). `on_exit(vm)` is called, at once, when the process ends without `kill`/`stop`
    having been asked for (QEMU crashed or was killed from outside)."""

    async def _wait(self) -> int:
        await self._ended.wait()
        assert self._exit_code is not None
        return self._exit_code

    def _watch_pidfd(self, fd: int, launcher: vm_launch.Launcher | None) -> None:
        """Learn of the process's end through its pidfd (readable once it has exited); its
        status comes from the launcher that reaps it (an adopted QEMU's parent is another)."""
        loop = asyncio.get_running_loop()
        pid = self.pid
        assert pid is not None

        async def status() -> None:
            code = None
            if launcher is not None:
                code = await asyncio.to_thread(launcher.exit_status, pid, EXIT_STATUS_TIMEOUT_S)
            self._exit_code = EXIT_UNKNOWN if code is None else code
            self._ended.set()

        def ended() -> None:
            loop.remove_reader(fd)
            os.close(fd)
            self._status_task = loop.create_task(status(), name=f"qemu-exit-{self.name}")

        loop.add_reader(fd, ended)

    async def _watch(self: Self) -> None:
        code = await self._wait()
        if self._expected_exit or self.on_exit is None:
            return
        log.warning("%s: QEMU (pid %s) ended unexpectedly with %s", self.name, self.pid, code)
        try:
            self.on_exit(self)
        except Exception:
            log.exception("%s: exit handler failed", self.name)

    def _start_watch(self) -> None:
        self._watcher = asyncio.create_task(self._watch(), name=f"qemu-watch-{self.name}")

    @classmethod
    async def adopt(
        cls,
        record: vm_registry.VMRecord,
        pid: int,
        *,
        accel: AccelChoice,
        registry: Path | None,
        on_exit: Callable[[QemuVM], None] | None = None,
        disk_limits: DiskLimits | None = None,
    ) -> QemuVM:
        """Take over a QEMU another (dead) server started: reconnect QMP, learn the disk
        chain from QEMU (seals may have moved it), watch the process through a pidfd.
        `disk_limits` are the adopting server's: QEMU kept the ones it was given, so they
        are set again only if they differ (None: none)."""
        spec = record.spec
        recorded = spec.get("disk_limits")
        m = spec["machine"]
        b = spec["boot"]
        net = spec["net"]
        vm = cls(
            name=record.name,
            workdir=Path(record.workdir),
            machine=MachineSpec(
                vcpus=m["vcpus"],
                memory_mb=m["memory_mb"],
                mem_file=None if m["mem_file"] is None else Path(m["mem_file"]),
                mem_shared=m["mem_shared"],
                balloon=m["balloon"],
            ),
            boot=BootSource(
                Path(b["kernel"]), None if b["initrd"] is None else Path(b["initrd"]), b["cmdline"]
            ),
            drives=[
                Drive(d["id"], Path(d["path"]), d["read_only"], d["fmt"]) for d in spec["drives"]
            ],
            accel=accel,
            net=None if net is None else NetIface(net["tap"], net["mac"], net["detached"]),
            netns=spec["netns"],
            cgroup=spec["cgroup"],
            qemu_binary=spec["qemu_binary"],
            incoming=spec["incoming"],
            ram_shim=None if spec["ram_shim"] is None else Path(spec["ram_shim"]),
            registry=registry,
            on_exit=on_exit,
            confine=bool(spec.get("confine", False)),
            disk_limits=None if recorded is None else DiskLimits(**recorded),
        )
        vm.launch_workdir = Path(spec.get("launch_workdir") or record.workdir)
        vm.qmp_socket = Path(record.qmp_socket)
        vm.launch_socket = Path(record.launch_socket or record.qmp_socket)
        vm._pid = pid
        vm._adopted = True
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError as exc:
            raise VMMError(f"{vm.name}: QEMU pid {pid} is gone") from exc
        vm._watch_pidfd(fd, None)
        vm._start_watch()
        try:
            await vm._connect_qmp()
            await vm._learn_block_nodes()
            if disk_limits != vm.disk_limits:
                await vm.set_disk_limits(disk_limits)
        except BaseException:
            await vm.kill()
            raise
        return vm

    def _check_inputs(self) -> None:
        files = [self.boot.kernel, *(d.path for d in self.drives)]
        if self.boot.initrd is not None:
            files.append(self.boot.initrd)
        for f in files:
            if not f.is_file():
                raise VMStartError(f"{self.name}: {f} does not exist")
        if self.netns is not None and not Path(f"/run/netns/{self.netns}").exists():
            raise VMStartError(f"{self.name}: network namespace {self.netns} does not exist")
        if private_ram(self.machine) and (self.ram_shim is None or not self.ram_shim.is_file()):
            raise VMStartError(
                f"{self.name}: RAM mapped from a shared snapshot needs the RAM preload library "
                f"({self.ram_shim or 'not given'}); run `aenv setup`"
            )
        if self.machine.vcpus < 1 or self.machine.memory_mb < 16:
            raise VMStartError(f"{self.name}: bad machine shape {self.machine}")
        if self.confine:
            gaps = vm_confine.missing_once(self.qemu_binary)
            if gaps:
                names = ", ".join(f"{p.name} ({p.detail})" for p in gaps)
                raise VMStartError(
                    f"{self.name}: VMM confinement needs {names}; fix the host or set "
                    "AGENTENV_CONFINE=off to run QEMU unconfined"
                )

    async def start(self) -> None:
        if self._pid is not None:
            raise VMMError(f"{self.name} was already started")
        self._check_inputs()
        self.workdir.mkdir(parents=True, exist_ok=True)
        if self.qmp_socket.parent != self.workdir:
            self.qmp_socket.parent.mkdir(parents=True, exist_ok=True)
        self.qmp_socket.unlink(missing_ok=True)
        self.launch_socket = self.qmp_socket
        self.launch_workdir = self.workdir
        try:
            # Written before the spawn: a server killed right after it still leaves a record
            # by which the next one finds this QEMU (its QMP socket path).
            spec = self.spec()
            self._write_record(spec)
            if self.cgroup is not None:
                self.cgroup.create(cgroup_limits(self.machine, self.accel))
            jail = None
            if self.confine:
                await asyncio.to_thread(self._prepare_files)
                jail = await asyncio.to_thread(self._jail)
            await self._spawn(self._launch_plan(jail))
            self.started_at = time.monotonic()
            self._write_record(spec)
            self._start_watch()
            await self._connect_qmp()
            if self.disk_limits is not None:
                # Before a restored guest runs; a cold-booted one is in its first
                # milliseconds of kernel boot, far from any disk IO.
                await self._throttle_disks(self.disk_limits)
        except BaseException:
            await self.kill()
            raise

    async def _spawn(self, plan: dict[str, Any]) -> None:
        """QEMU started by this server's launcher (`vmm.launch`): the only process a start
        spawns. Its stdout and stderr go to `stderr_log`."""
        launcher = vm_launch.shared()
        with self.stderr_log.open("wb") as err:

            async def launched() -> None:
                pid, fd = await asyncio.to_thread(launcher.launch, plan, err.fileno(), err.fileno())
                self._pid = pid
                self._watch_pidfd(fd, launcher)

            # A cancel waits for the launch: a QEMU started meanwhile is then ours to kill
            # (`start` does), not left running untracked.
            await aio.whole(launched())

    async def _connect_qmp(self) -> None:
        deadline = time.monotonic() + QMP_CONNECT_TIMEOUT_S
        while True:
            if self.exit_code is not None:
                raise VMStartError(f"{self.name}: qemu exited: {self._stderr_tail()}")
            if self.qmp_socket.exists():
                qmp = QuietQMPClient(self.name)
                try:
                    async with asyncio.timeout(max(0.1, deadline - time.monotonic())):
                        await qmp.connect(str(self.qmp_socket))
                except Exception as exc:
                    if time.monotonic() > deadline:
                        raise VMStartError(f"{self.name}: QMP connect failed: {exc}") from exc
                else:
                    self._qmp = qmp
                    return
            if time.monotonic() > deadline:
                raise VMStartError(f"{self.name}: QMP did not come up: {self._stderr_tail()}")
            await asyncio.sleep(0.005)

    def _stderr_tail(self) -> str:
        try:
            lines = self.stderr_log.read_text(errors="replace").strip().splitlines()
        except OSError:
            return "no output"
        return lines[-1] if lines else "no output"

    async def wait_exit(self) -> int:
        if self.pid is None:
            raise VMMError(f"{self.name} was never started")
        self._expected_exit = True
        code = await self._wait()
        await self._cleanup()
        return code

    async def stop(self, grace_s: float = 5.0) -> None:
        """Power button first; then QEMU's own `quit`; SIGKILL as the last resort."""
        self._expected_exit = True
        if self.pid is None or self.exit_code is not None:
            await self._cleanup()
            return
        with contextlib.suppress(Exception):
            await self._execute("system_powerdown")
            async with asyncio.timeout(grace_s):
                await self._wait()
        if self.exit_code is None:
            with contextlib.suppress(Exception):
                await self._execute("quit")
                async with asyncio.timeout(2.0):
                    await self._wait()
        await self.kill()

    async def kill(self) -> None:
        # Whole: a cancel that reached a kill between its SIGKILL and its cleanup left the
        # QEMU's cgroup behind (a converter cancelled by a delete, in a whole-suite run).
        await aio.whole(self._kill())

    async def _kill(self) -> None:
        self._expected_exit = True
        pid = self.pid
        if pid is not None and self.exit_code is None:
            with contextlib.suppress(ProcessLookupError):
                # QEMU itself (PID 1 of its namespace: from outside, SIGKILL reaches it).
                os.kill(pid, signal.SIGKILL)
            try:
                async with asyncio.timeout(KILL_TIMEOUT_S):
                    await self._wait()
            except TimeoutError:
                raise VMMError(
                    f"{self.name}: QEMU pid {pid} did not end {KILL_TIMEOUT_S:.0f}s after SIGKILL"
                ) from None
        await self._cleanup()

    async def _cleanup(self) -> None:
        if self._cleaned or (self.pid is not None and self.exit_code is None):
            return
        self._cleaned = True
        if self._qmp is not None:
            with contextlib.suppress(Exception):
                await self._qmp.disconnect()
            self._qmp = None
        remove_socket(self.qmp_socket)
        if self.registry is not None or self.cgroup is not None:
            # One thread hop for both. The cgroup goes first: a crash (or a cgroup that will
            # not go) in between leaves the record, which the node's next start reaps with
            # whatever it names; an empty cgroup without a record nothing would find.
            await asyncio.to_thread(self._forget)

    def _forget(self) -> None:
        if self.cgroup is not None:
            self.cgroup.remove()
        if self.registry is not None:
            vm_registry.remove(self.registry, self.name, self.pid)

    async def pause(self) -> None:
        await self._execute("stop")

    async def resume(self) -> None:
        await self._execute("cont")

    async def status(self) -> VMStatus:
        if self.pid is None:
            return VMStatus.CREATED
        if self.exit_code is not None or self._qmp is None:
            return VMStatus.STOPPED
        reply = await self._execute("query-status")
        assert isinstance(reply, dict)
        return _STATUS.get(str(reply.get("status")), VMStatus.RUNNING)

    def rename(self, name: str) -> None:
        """Run on under another name (a warm pool's guest taken by a sandbox whose id the
        control plane chose): the cgroup follows, and the VM's record is written under the
        new name before the old one goes, so a crash in between leaves the QEMU findable."""
        old = self.name
        if self.cgroup is not None:
            self.cgroup.rename(name)
        self.name = name
        self._write_record()
        if self.registry is not None:
            vm_registry.remove(self.registry, old)

    def relocate(self, workdir: Path) -> None:
        """Follow a rename of the workdir that the caller made while QEMU runs. QEMU keeps
        the files it opened (disks, serial log) by descriptor and still listens on the moved
        socket; only paths named later (a seal's new upper, a RAM stream, cleanup) must use
        the new place."""
        old = self.workdir

        def moved(path: Path) -> Path:
            return workdir / path.relative_to(old) if path.is_relative_to(old) else path

        self.workdir = workdir
        self.serial_log = moved(self.serial_log)
        self.stderr_log = moved(self.stderr_log)
        self.qmp_socket = moved(self.qmp_socket)
        self._paths = {k: moved(v) for k, v in self._paths.items()}
        self.drives = [replace(d, path=moved(d.path)) for d in self.drives]
        if self.machine.mem_file is not None:
            self.machine = replace(self.machine, mem_file=moved(self.machine.mem_file))
        self._write_record()

    # -- balloon ----------------------------------------------------------------------------

    @property
    def balloon_reclaims(self) -> bool:
        """Inflating the balloon returns memory to the host (every guest with a balloon: a
        clone's discards go through the preload library)."""
        return self.machine.balloon

    async def balloon_set(self, target_bytes: int) -> None:
        """Ask the guest to give back memory until it has `target_bytes` (the full size
        deflates). Returns at once; the guest moves towards the target on its own
        (`balloon_query`)."""
        full = self.machine.memory_mb * 1024 * 1024
        if not self.machine.balloon:
            raise BalloonUnsupported(f"{self.name} has no balloon device")
        if not 0 < target_bytes <= full:
            raise VMMError(f"{self.name}: balloon target {target_bytes} is outside 1..{full} bytes")
        await self._execute("balloon", {"value": target_bytes})

    async def balloon_query(self) -> int:
        """Bytes of RAM the guest holds now (guest memory minus the balloon)."""
        if not self.machine.balloon:
            raise BalloonUnsupported(f"{self.name} has no balloon device")
        reply = await self._execute("query-balloon")
        if not isinstance(reply, dict) or not isinstance(reply.get("actual"), int):
            raise VMMError(f"{self.name}: query-balloon answered {reply!r}")
        return int(reply["actual"])
