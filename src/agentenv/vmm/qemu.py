"""QEMU `-M microvm` driver over QMP: one process per guest, in a netns and a cgroup."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from qemu.qmp import QMPClient

from agentenv.storage.images import create_overlay_sync
from agentenv.vmm import confine as vm_confine
from agentenv.vmm import registry as vm_registry
from agentenv.vmm.accel import AccelChoice
from agentenv.vmm.base import BootSource, DiskLimits, Drive, MachineSpec, NetIface, VMStatus
from agentenv.vmm.cgroup import Cgroup, Limits
from agentenv.vmm.errors import BalloonUnsupported, VMMError, VMStartError
from agentenv.vmm.ramshim import preload_argv
from agentenv.vmm.version import microvm_machine, qemu_version

log = logging.getLogger(__name__)

# sun_path holds 108 bytes; deep temporary dirs can exceed it.
_MAX_SOCK_PATH = 100
_SOCK_FALLBACK_DIR = Path("/run/agentenv-qmp")
QMP_CONNECT_TIMEOUT_S = 10.0
# No QMP command of ours takes long (migrations run in the background and are polled); one
# that does not answer in this time means a stuck QEMU.
QMP_COMMAND_TIMEOUT_S = 30.0
# A SIGKILLed process is gone within milliseconds unless the kernel holds it (D state).
KILL_TIMEOUT_S = 30.0
# The exit status of an adopted QEMU (not our child: its parent reaps it, we only see it end).
EXIT_UNKNOWN = -1
# QEMU itself (TCG code cache, device state, page tables) on top of the guest's RAM.
MEMORY_OVERHEAD_MB = 192
PIDS_LIMIT = 256
SNAPSHOT_TIMEOUT_S = 60.0
# QEMU throttles migration to ~128 MiB/s by default; a local file takes much more.
MIGRATE_BANDWIDTH = 16 * 1024**3

# A migration that failed with less than this free where it wrote ran out of space.
FULL_BELOW_BYTES = 16 * 1024 * 1024


def remove_socket(path: Path) -> None:
    """A QMP socket, and the directory of its own a confined VM with a long path got."""
    path.unlink(missing_ok=True)
    if path.parent.parent == _SOCK_FALLBACK_DIR:
        with contextlib.suppress(OSError):
            path.parent.rmdir()


def _children(pid: int) -> list[int]:
    # A procfs read: answered from memory, never blocks.
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(x) for x in f.read().split()]
    except (OSError, ValueError):
        return []


def _free_bytes(path: Path) -> int | None:
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


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


# Bumped whenever the devices a guest gets change: device state saved with one set does not
# load into another. 2: free page reporting for every guest (clones through `ramshim`).
DEVICE_SET = "2"


# Every guest's balloon: free page reporting and deflate-on-oom. A guest whose RAM is a private
# mapping of a shared snapshot file discards through the preload library (`ramshim`), so its
# freed pages never reach that file. One device for every VM: snapshots load only into the
# device set that saved them.
BALLOON_DEVICE = "virtio-balloon-device,free-page-reporting=on,deflate-on-oom=on"


def private_ram(machine: MachineSpec) -> bool:
    """Guest RAM is a copy-on-write mapping of a memory file other guests map too."""
    return machine.mem_file is not None and not machine.mem_shared


def cgroup_limits(machine: MachineSpec) -> Limits:
    return Limits(
        memory_bytes=(machine.memory_mb + MEMORY_OVERHEAD_MB) * 1024 * 1024,
        cpus=float(machine.vcpus),
        pids=PIDS_LIMIT,
    )


class QemuVM:
    """A microvm guest. Every file it makes lives in `workdir` (serial log, QEMU's stderr,
    QMP socket); `kill()`/`stop()` release the process, the cgroup and the socket, also after
    a start that failed half way.

    With a `registry` directory the VM keeps a record there while its process lives
    (`vmm.registry`), so a server that died can be followed by one that finds it again
    (`adopt`). `on_exit(vm)` is called, at once, when the process ends without `kill`/`stop`
    having been asked for (QEMU crashed or was killed from outside)."""

    def __init__(
        self,
        *,
        name: str,
        workdir: Path,
        machine: MachineSpec,
        boot: BootSource,
        drives: list[Drive],
        accel: AccelChoice,
        net: NetIface | None = None,
        netns: str | None = None,
        cgroup: bool = True,
        qemu_binary: str = "qemu-system-x86_64",
        incoming: bool = False,
        ram_shim: Path | None = None,
        registry: Path | None = None,
        on_exit: Callable[[QemuVM], None] | None = None,
        confine: bool = True,
        disk_limits: DiskLimits | None = None,
    ) -> None:
        self.name = name
        self.workdir = workdir
        # Own uid, mount namespace and root, seccomp (`vmm.confine`).
        self.confine = confine
        self.uid, self.gid = vm_confine.vm_ids(name, netns)
        # Where QEMU sees its workdir: the place it was launched in (its root binds it
        # there), also after `relocate` moved it on the host.
        self.launch_workdir = workdir
        self.machine = machine
        self.boot = boot
        self.drives = drives
        self.accel = accel
        self.net = net
        self.netns = netns
        self.qemu_binary = qemu_binary
        self.version = qemu_version(qemu_binary)
        # The preload library a private mapping of a shared memory file needs (`ramshim`).
        self.ram_shim = ram_shim
        # Host IO each writable drive may use, set over QMP once QEMU answers (`start`).
        self.disk_limits = disk_limits
        # Started paused, waiting for `snapshot_load` instead of booting the kernel.
        self.incoming = incoming
        self.serial_log = workdir / "serial.log"
        self.stderr_log = workdir / "qemu.stderr"
        sock = workdir / "qmp.sock"
        if len(str(sock)) > _MAX_SOCK_PATH:
            # A directory per VM: a confined QEMU sees that one, not every VM's socket.
            sock = (
                _SOCK_FALLBACK_DIR / name / "qmp.sock"
                if confine
                else _SOCK_FALLBACK_DIR / f"{name}.sock"
            )
        self.qmp_socket = sock
        # Where QEMU was told to listen; `relocate` moves the socket, not this.
        self.launch_socket = sock
        self.cgroup = Cgroup(name) if cgroup else None
        self.registry = registry
        self.on_exit = on_exit
        self._proc: asyncio.subprocess.Process | None = None
        # A confined QEMU in a PID namespace is the child of the `unshare` we spawn.
        self._vmm_pid: int | None = None
        # An adopted QEMU (another server started it): its PID, and a pidfd that becomes
        # readable when it ends.
        self._adopted_pid: int | None = None
        self._adopted_code: int | None = None
        self._ended = asyncio.Event()
        self._expected_exit = False
        self._watcher: asyncio.Task[None] | None = None
        self._qmp: QMPClient | None = None
        self._top: dict[str, str] = {d.id: f"{d.id}-0" for d in drives}
        self._seals: dict[str, int] = {d.id: 0 for d in drives}
        self._paths: dict[str, Path] = {d.id: d.path for d in drives}
        self._cleaned = False
        self._fd_lock = asyncio.Lock()
        self._fd_seq = 0
        self.started_at: float | None = None

    # -- argv -------------------------------------------------------------------------------

    def argv(self) -> list[str]:
        m = self.machine
        machine_opts = microvm_machine(self.version)
        args = [self.qemu_binary]
        if m.mem_file is not None:
            machine_opts += ",memory-backend=mem"
            args += [
                "-object",
                f"memory-backend-file,id=mem,size={m.memory_mb}M,mem-path={m.mem_file},"
                f"share={'on' if m.mem_shared else 'off'}",
            ]
        args += ["-M", machine_opts, *self.accel.qemu_args]
        args += ["-smp", str(m.vcpus), "-m", f"{m.memory_mb}M"]
        args += ["-nodefaults", "-no-user-config", "-display", "none", "-no-reboot"]
        args += ["-serial", f"file:{self.serial_log}"]
        args += ["-qmp", f"unix:{self.qmp_socket},server=on,wait=off"]
        args += ["-kernel", str(self.boot.kernel)]
        if self.boot.initrd is not None:
            args += ["-initrd", str(self.boot.initrd)]
        words = self.boot.cmdline.split()
        words += [w for w in self.accel.cmdline if w not in words]
        cmdline = " ".join(words)
        if cmdline:
            args += ["-append", cmdline]
        for d in self.drives:
            node = {
                "driver": d.fmt,
                "node-name": f"{d.id}-0",
                "read-only": d.read_only,
                "file": {
                    "driver": "file",
                    "filename": str(d.path),
                    "read-only": d.read_only,
                    # Open for writing only while something writes: a sealed upper is
                    # reopened read-only (a confined QEMU may not write the sealed file,
                    # and QEMU 7.2 reopens it by name when a migration inactivates disks).
                    "auto-read-only": not d.read_only,
                },
            }
            args += ["-blockdev", json.dumps(node, separators=(",", ":"))]
            args += ["-device", f"virtio-blk-device,drive={d.id}-0,id={d.id}"]
        if self.net is not None:
            args += [
                "-netdev",
                f"tap,id=n0,ifname={self.net.tap},script=no,downscript=no",
                "-device",
                f"virtio-net-device,netdev=n0,mac={self.net.mac}",
            ]
        if m.balloon:
            args += ["-device", BALLOON_DEVICE]
        if self.incoming:
            args += ["-S", "-incoming", "defer"]
        if self.confine:
            args += ["-sandbox", vm_confine.SANDBOX]
        return args

    def _in_vm(self, path: Path) -> Path:
        """The name QEMU knows a host path by (its root has the workdir where it was)."""
        if path.is_relative_to(self.workdir):
            return self.launch_workdir / path.relative_to(self.workdir)
        return path

    def _from_vm(self, path: Path) -> Path:
        if path.is_relative_to(self.launch_workdir):
            return self.workdir / path.relative_to(self.launch_workdir)
        return path

    def _jail(self) -> vm_confine.Jail:
        """The root this VM's QEMU gets: everything it opens, nothing else (reads disk
        headers: not on the event loop)."""
        jail = vm_confine.Jail(
            self.uid,
            self.gid,
            rw_dirs=[self.launch_workdir],
            programs=(self.qemu_binary, *vm_confine.QEMU_HELPERS),
        )
        if not self.qmp_socket.is_relative_to(self.launch_workdir):
            jail.rw_dirs.append(self.qmp_socket.parent)
        jail.add_ro(self.boot.kernel)
        if self.boot.initrd is not None:
            jail.add_ro(self.boot.initrd)
        for d in self.drives:
            if d.read_only:
                jail.add_ro(d.path)
            else:
                jail.add_rw(d.path)
            for backing in vm_confine.backing_chain(d.path):
                jail.add_ro(backing)
        m = self.machine
        if m.mem_file is not None:
            if m.mem_shared:
                jail.add_rw(m.mem_file)
            else:
                jail.add_ro(m.mem_file)
        if private_ram(m) and self.ram_shim is not None:
            jail.add_ro(self.ram_shim)
        if self.net is not None:
            jail.devices.append("/dev/net/tun")
            if self.net.detached:
                jail.make_tap = self.net.tap
        if "kvm" in self.accel.qemu_args:
            jail.devices.append("/dev/kvm")
        return jail

    def _prepare_files(self) -> None:
        """Give the VM's uid what it writes; the workdir stays the server's (sticky, the
        VM's group), so QEMU can add files to it but not touch the server's."""
        vm_confine.prepare_host()
        vm_confine.own_dir(self.workdir, self.gid)
        if not self.qmp_socket.is_relative_to(self.workdir):
            vm_confine.own_dir(self.qmp_socket.parent, self.gid)
        mine = [d.path for d in self.drives if not d.read_only]
        m = self.machine
        if m.mem_file is not None and m.mem_shared:
            if not m.mem_file.is_relative_to(self.workdir) and not m.mem_file.exists():
                # Bound into the root by name, so it must exist before QEMU does.
                m.mem_file.touch(0o600)
            mine.append(m.mem_file)
        mine.append(self.serial_log)
        for path in mine:
            if path.exists():
                vm_confine.give(path, self.uid, self.gid)
        # What it only reads but another VM's uid owns (a converter reads the paused
        # sandbox's upper): the server's from now on, readable by any VM that gets it bound.
        for d in self.drives:
            for path in [*([d.path] if d.read_only else []), *vm_confine.backing_chain(d.path)]:
                with contextlib.suppress(FileNotFoundError):
                    if path.stat().st_uid != 0:
                        vm_confine.disown(path)

    def _launch_argv(self, jail: vm_confine.Jail | None = None) -> list[str]:
        argv = self.argv()
        if private_ram(self.machine):
            assert self.ram_shim is not None and self.machine.mem_file is not None
            argv = [*preload_argv(self.ram_shim, self.machine.mem_file), *argv]
        if jail is not None:
            argv = jail.wrap(argv, pid_ns=vm_confine.pid_namespaces())
        if self.net is not None and self.net.detached:
            # The device state of virtio-net needs a tap backend (vnet_hdr); a namespace of
            # its own gives it one that disappears with the process.
            argv = ["unshare", "--net", "--", *argv]
        elif self.netns is not None:
            argv = ["nsenter", f"--net=/run/netns/{self.netns}", "--", *argv]
        if self.cgroup is not None:
            # The shell joins the cgroup and then execs, so QEMU never runs outside it and
            # keeps the PID we track.
            argv = ["sh", "-c", self.cgroup.join_script() + 'exec "$@"', "sh", *argv]
        return argv

    # -- lifecycle --------------------------------------------------------------------------

    @property
    def pid(self) -> int | None:
        """QEMU's PID (not that of the `unshare` in front of a confined one)."""
        if self._proc is None:
            return self._adopted_pid
        return self._vmm_pid or self._proc.pid

    @property
    def exit_code(self) -> int | None:
        """QEMU's exit status once it has ended (also when nobody awaited it);
        `EXIT_UNKNOWN` for an adopted QEMU."""
        return self._adopted_code if self._proc is None else self._proc.returncode

    @property
    def adopted(self) -> bool:
        return self._adopted_pid is not None

    async def _wait(self) -> int:
        if self._proc is not None:
            return await self._proc.wait()
        await self._ended.wait()
        return EXIT_UNKNOWN

    async def _watch(self) -> None:
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

    def spec(self) -> dict[str, Any]:
        """What this VM is built from, as JSON (the registry record's `spec`)."""
        spec: dict[str, Any] = json.loads(
            json.dumps(
                {
                    "machine": asdict(self.machine),
                    "boot": asdict(self.boot),
                    "drives": [asdict(d) for d in self.drives],
                    "net": None if self.net is None else asdict(self.net),
                    "netns": self.netns,
                    "cgroup": self.cgroup is not None,
                    "qemu_binary": self.qemu_binary,
                    "incoming": self.incoming,
                    "ram_shim": None if self.ram_shim is None else str(self.ram_shim),
                    "confine": self.confine,
                    "launch_workdir": str(self.launch_workdir),
                    "disk_limits": None if self.disk_limits is None else asdict(self.disk_limits),
                },
                default=str,
            )
        )
        return spec

    def _record(self) -> vm_registry.VMRecord:
        pid = self.pid
        return vm_registry.VMRecord(
            name=self.name,
            workdir=str(self.workdir),
            qmp_socket=str(self.qmp_socket),
            launch_socket=str(self.launch_socket),
            pid=pid,
            starttime=None if pid is None else vm_registry.proc_starttime(pid),
            spec=self.spec(),
        )

    def _write_record(self) -> None:
        if self.registry is not None:
            vm_registry.write(self.registry, self._record())

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
        vm._adopted_pid = pid
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError as exc:
            raise VMMError(f"{vm.name}: QEMU pid {pid} is gone") from exc
        loop = asyncio.get_running_loop()

        def ended() -> None:
            loop.remove_reader(fd)
            os.close(fd)
            vm._adopted_code = EXIT_UNKNOWN
            vm._ended.set()

        loop.add_reader(fd, ended)
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

    async def _learn_block_nodes(self) -> None:
        reply = await self._execute("query-block")
        assert isinstance(reply, list)
        for entry in reply:
            inserted = entry.get("inserted") if isinstance(entry, dict) else None
            if not isinstance(inserted, dict):
                continue
            node = str(inserted.get("node-name", ""))
            drive_id, _, n = node.rpartition("-")
            if drive_id in self._top and n.isdigit():
                self._top[drive_id] = node
                self._seals[drive_id] = int(n)
                self._paths[drive_id] = self._from_vm(Path(str(inserted["file"])))

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
            gaps = vm_confine.missing(self.qemu_binary)
            if gaps:
                names = ", ".join(f"{p.name} ({p.detail})" for p in gaps)
                raise VMStartError(
                    f"{self.name}: VMM confinement needs {names}; fix the host or set "
                    "AGENTENV_CONFINE=off to run QEMU unconfined"
                )

    async def start(self) -> None:
        if self._proc is not None:
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
            self._write_record()
            if self.cgroup is not None:
                self.cgroup.create(cgroup_limits(self.machine))
            jail = None
            if self.confine:
                await asyncio.to_thread(self._prepare_files)
                jail = await asyncio.to_thread(self._jail)
            with self.stderr_log.open("wb") as err:
                self._proc = await asyncio.create_subprocess_exec(
                    *self._launch_argv(jail),
                    stdin=asyncio.subprocess.DEVNULL,
                    stdout=err,
                    stderr=err,
                    # Its own session: QEMU outlives a server killed by SIGKILL, and the next
                    # server adopts it.
                    start_new_session=True,
                )
            self.started_at = time.monotonic()
            if jail is not None and vm_confine.pid_namespaces():
                self._vmm_pid = await self._launched_child()
            self._write_record()
            self._start_watch()
            await self._connect_qmp()
            if self.disk_limits is not None:
                # Before a restored guest runs; a cold-booted one is in its first
                # milliseconds of kernel boot, far from any disk IO.
                await self._throttle_disks(self.disk_limits)
        except BaseException:
            await self.kill()
            raise

    async def _launched_child(self) -> int | None:
        """The PID of the process `unshare --fork` made (QEMU, once it has exec'd); None if
        the launcher ended first (`_connect_qmp` reports why)."""
        assert self._proc is not None
        pid = self._proc.pid
        deadline = time.monotonic() + QMP_CONNECT_TIMEOUT_S
        while time.monotonic() < deadline and self._proc.returncode is None:
            found = _children(pid)
            if found:
                return found[0]
            await asyncio.sleep(0.001)
        return None

    async def _connect_qmp(self) -> None:
        deadline = time.monotonic() + QMP_CONNECT_TIMEOUT_S
        while True:
            if self.exit_code is not None:
                raise VMStartError(f"{self.name}: qemu exited: {self._stderr_tail()}")
            if self.qmp_socket.exists():
                qmp = QMPClient(self.name)
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
        self._expected_exit = True
        pid = self.pid
        if pid is not None and self.exit_code is None:
            with contextlib.suppress(ProcessLookupError):
                if self._proc is not None and self._vmm_pid not in (None, self._proc.pid):
                    # QEMU, not its launcher: `unshare --fork` reaps QEMU and exits. Killed
                    # first, the launcher would orphan QEMU to the host's init, which need not
                    # reap it (a zombie that looks alive to kill(pid, 0)).
                    os.kill(pid, signal.SIGKILL)
                elif self._proc is not None:
                    # Its own session and process group: the launcher and a QEMU not yet
                    # found in its PID namespace go together.
                    os.killpg(self._proc.pid, signal.SIGKILL)
                else:
                    os.kill(pid, signal.SIGKILL)
            try:
                async with asyncio.timeout(KILL_TIMEOUT_S):
                    await self._wait()
            except TimeoutError:
                if self._proc is not None:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(self._proc.pid, signal.SIGKILL)
                raise VMMError(
                    f"{self.name}: QEMU pid {pid} did not end {KILL_TIMEOUT_S:.0f}s after SIGKILL"
                ) from None
        await self._cleanup()

    async def _cleanup(self) -> None:
        if self._cleaned or (self.pid is not None and self.exit_code is None):
            return
        self._cleaned = True
        if self.registry is not None:
            await asyncio.to_thread(vm_registry.remove, self.registry, self.name, self.pid)
        if self._qmp is not None:
            with contextlib.suppress(Exception):
                await self._qmp.disconnect()
            self._qmp = None
        remove_socket(self.qmp_socket)
        if self.cgroup is not None:
            await asyncio.to_thread(self.cgroup.remove)

    # -- QMP operations ---------------------------------------------------------------------

    async def _execute(self, cmd: str, args: dict[str, object] | None = None) -> object:
        if self._qmp is None:
            raise VMMError(f"{self.name} is not running")
        try:
            async with asyncio.timeout(QMP_COMMAND_TIMEOUT_S):
                return await self._qmp.execute(cmd, args)
        except TimeoutError:
            raise VMMError(
                f"{self.name}: QMP {cmd} did not answer in {QMP_COMMAND_TIMEOUT_S:.0f}s"
            ) from None
        except Exception as exc:
            raise VMMError(f"{self.name}: QMP {cmd} failed: {exc}") from exc

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

    async def seal_disk(self, drive_id: str, new_upper: Path) -> Path:
        if drive_id not in self._top:
            raise VMMError(f"{self.name} has no drive {drive_id!r}")
        if self.confine and not new_upper.is_relative_to(self.workdir):
            # A confined QEMU's root has its workdir, not the rest of the host.
            raise VMMError(f"{self.name}: a new upper must be in {self.workdir}, not {new_upper}")
        old_path = self._paths[drive_id]
        await asyncio.to_thread(create_overlay_sync, old_path, new_upper)
        if self.confine:
            await asyncio.to_thread(vm_confine.give, new_upper, self.uid, self.gid)
        n = self._seals[drive_id] + 1
        node = f"{drive_id}-{n}"
        try:
            await self._execute(
                "blockdev-add",
                {
                    "driver": "qcow2",
                    "node-name": node,
                    "file": {
                        "driver": "file",
                        "filename": str(self._in_vm(new_upper)),
                        "auto-read-only": True,
                    },
                    # The overlay's backing is the live node, attached by blockdev-snapshot.
                    "backing": None,
                },
            )
            try:
                await self._execute(
                    "blockdev-snapshot", {"node": self._top[drive_id], "overlay": node}
                )
            except BaseException:
                with contextlib.suppress(Exception):
                    await self._execute("blockdev-del", {"node-name": node})
                raise
        except BaseException:
            await asyncio.to_thread(new_upper.unlink, True)
            raise
        self._seals[drive_id] = n
        self._top[drive_id] = node
        self._paths[drive_id] = new_upper
        # QEMU now opens the old upper read-only; the file mode keeps everyone else honest,
        # and a confined QEMU no longer owns it (so cannot make it writable again).
        if self.confine:
            await asyncio.to_thread(vm_confine.disown, old_path)
        await asyncio.to_thread(old_path.chmod, 0o444)
        return old_path

    async def _throttle_disks(self, limits: DiskLimits) -> None:
        # On the device's BlockBackend (named by the qdev id), not on a node: a seal's
        # `blockdev-snapshot` puts a new top under the same backend, which keeps the limit
        # (checked by `query-block`, tests/vmm). All zeros turns throttling off. Not migrated
        # state: a restored guest gets it from its own QEMU's start.
        for d in self.drives:
            if d.read_only:
                continue
            await self._execute(
                "block_set_io_throttle",
                {
                    "id": d.id,
                    "bps": limits.bytes_per_s,
                    "bps_rd": 0,
                    "bps_wr": 0,
                    "iops": limits.iops,
                    "iops_rd": 0,
                    "iops_wr": 0,
                },
            )

    async def set_disk_limits(self, limits: DiskLimits | None) -> None:
        """Change the IO limits of every writable drive while QEMU runs (None: none)."""
        await self._throttle_disks(limits or DiskLimits())
        self.disk_limits = limits
        await asyncio.to_thread(self._write_record)

    async def disk_limits_in_effect(self) -> dict[str, DiskLimits]:
        """What QEMU enforces now, per drive id (`query-block`; zeros: none)."""
        reply = await self._execute("query-block")
        found: dict[str, DiskLimits] = {}
        for entry in reply if isinstance(reply, list) else []:
            inserted = entry.get("inserted") if isinstance(entry, dict) else None
            # The qdev id itself here (7.2); a QOM path names it as one of its parts.
            qdev = str(entry.get("qdev", "")) if isinstance(entry, dict) else ""
            drive = next((p for p in [qdev, *qdev.split("/")] if p in self._top), None)
            if isinstance(inserted, dict) and drive is not None:
                found[drive] = DiskLimits(int(inserted.get("bps", 0)), int(inserted.get("iops", 0)))
        return found

    def disk_path(self, drive_id: str) -> Path:
        """The file that currently takes the drive's writes."""
        return self._paths[drive_id]

    async def resize_disk(self, drive_id: str, size_bytes: int) -> None:
        """Grow the drive's writable top to `size_bytes` while the guest runs. The device
        tells the guest (virtio config change), whose kernel takes the new capacity; a
        restored guest needs this because its device state carries the old one."""
        if drive_id not in self._top:
            raise VMMError(f"{self.name} has no drive {drive_id!r}")
        await self._execute("block_resize", {"node-name": self._top[drive_id], "size": size_bytes})

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

    async def _ignore_shared(self, on: bool = True) -> None:
        # On: RAM lives in the memory file, so migration writes device state only (~50 KB).
        # Off: RAM goes into the stream too. Both ends must agree.
        await self._execute(
            "migrate-set-capabilities",
            {"capabilities": [{"capability": "x-ignore-shared", "state": on}]},
        )

    async def _wait_migration(self, what: str) -> None:
        deadline = time.monotonic() + SNAPSHOT_TIMEOUT_S
        while time.monotonic() < deadline:
            reply = await self._execute("query-migrate")
            status = reply.get("status") if isinstance(reply, dict) else None
            if status == "completed":
                return
            if status in ("failed", "cancelled"):
                detail = reply.get("error-desc", status) if isinstance(reply, dict) else status
                raise VMMError(f"{self.name}: {what} failed: {detail}")
            await asyncio.sleep(0.002)
        raise VMMError(f"{self.name}: {what} did not finish in {SNAPSHOT_TIMEOUT_S:.0f}s")

    async def _wait_incoming(self, what: str) -> None:
        """The destination's `query-migrate` says completed before the state is applied on
        some versions; the run state leaving `inmigrate` is the reliable signal."""
        await self._wait_migration(what)
        deadline = time.monotonic() + SNAPSHOT_TIMEOUT_S
        while time.monotonic() < deadline:
            reply = await self._execute("query-status")
            if isinstance(reply, dict) and reply.get("status") != "inmigrate":
                return
            await asyncio.sleep(0.002)
        raise VMMError(f"{self.name}: {what} did not finish in {SNAPSHOT_TIMEOUT_S:.0f}s")

    async def _pass_fd(self, fd: int) -> str:
        """Hand QEMU an open descriptor (SCM_RIGHTS on the QMP socket, then `getfd`); the
        name it is known by there. QEMU opens no file and starts no helper for a stream, so
        neither its root nor its seccomp filter needs to allow one."""
        if self._qmp is None:
            raise VMMError(f"{self.name} is not running")
        async with self._fd_lock:
            self._fd_seq += 1
            name = f"stream{self._fd_seq}"
            try:
                self._qmp.send_fd_scm(fd)
            except Exception as exc:
                raise VMMError(f"{self.name}: passing a descriptor failed: {exc}") from exc
            await self._execute("getfd", {"fdname": name})
        return name

    async def _migrate_out(self, path: Path, what: str) -> None:
        await self._execute("migrate-set-parameters", {"max-bandwidth": MIGRATE_BANDWIDTH})
        await self._execute("stop")
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC
        fd = await asyncio.to_thread(os.open, path, flags, 0o644)
        try:
            fdname = await self._pass_fd(fd)
        finally:
            os.close(fd)
        try:
            await self._execute("migrate", {"uri": f"fd:{fdname}"})
        except VMMError:
            with contextlib.suppress(VMMError):
                await self._execute("closefd", {"fdname": fdname})
            raise
        try:
            await self._wait_migration(what)
        except VMMError as exc:
            # QEMU's write fails with little detail; a full filesystem is why, and callers
            # map it.
            free = await asyncio.to_thread(_free_bytes, path.parent)
            if free is not None and free < FULL_BELOW_BYTES:
                raise VMMError(
                    f"{exc}: No space left on device ({path.parent}, {free // 1024} KiB free)"
                ) from exc
            raise

    async def _migrate_in(self, path: Path, what: str, run: bool) -> None:
        if not self.incoming:
            raise VMMError(f"{self.name} was not started to receive a snapshot")
        if not await asyncio.to_thread(path.is_file):
            raise VMMError(f"{self.name}: snapshot state {path} does not exist")
        fd = await asyncio.to_thread(os.open, path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            fdname = await self._pass_fd(fd)
        finally:
            os.close(fd)
        try:
            await self._execute("migrate-incoming", {"uri": f"fd:{fdname}"})
        except VMMError:
            with contextlib.suppress(VMMError):
                await self._execute("closefd", {"fdname": fdname})
            raise
        await self._wait_incoming(what)
        if run:
            await self._execute("cont")

    async def snapshot_create(self, state_path: Path) -> None:
        if self.machine.mem_file is None or not self.machine.mem_shared:
            raise VMMError(f"{self.name}: snapshots need guest RAM in a shared memory file")
        await self._ignore_shared(True)
        await self._migrate_out(state_path, "snapshot")

    async def snapshot_load(self, state_path: Path, *, run: bool = True) -> None:
        if self.incoming:
            await self._ignore_shared(True)
        await self._migrate_in(state_path, "restore", run)

    async def stream_save(self, stream_path: Path) -> None:
        await self._ignore_shared(False)
        await self._migrate_out(stream_path, "RAM snapshot")

    async def stream_load(self, stream_path: Path, *, run: bool = True) -> None:
        if self.incoming:
            await self._ignore_shared(False)
        await self._migrate_in(stream_path, "RAM restore", run)

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
