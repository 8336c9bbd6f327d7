"""The state every QEMU driver part shares (`QemuBase`): what the VM is built from, the
process it runs as, the names QEMU knows its files by, its registry record, and the one
way a QMP command is sent (with a deadline). Split from `qemu.py` so the command line
(`qemu_argv`), the disks (`qemu_disks`) and migration (`qemu_migration`) each hold their
own methods over it; `qemu.QemuVM` puts them together."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Any, Self

from qemu.qmp import ExecuteError, Message, QMPClient

from agentenv.files import SandboxFiles
from agentenv.vmm import confine as vm_confine
from agentenv.vmm import registry as vm_registry
from agentenv.vmm.accel import AccelChoice
from agentenv.vmm.base import BootSource, DiskLimits, Drive, MachineSpec, NetIface
from agentenv.vmm.cgroup import Cgroup
from agentenv.vmm.errors import VMMError
from agentenv.vmm.version import qemu_version

# sun_path holds 108 bytes; deep temporary dirs can exceed it.
_MAX_SOCK_PATH = 100
SOCK_FALLBACK_DIR = Path("/run/agentenv-qmp")
# No QMP command of ours takes long (migrations run in the background and are polled); one
# that does not answer in this time means a stuck QEMU.
QMP_COMMAND_TIMEOUT_S = 30.0
# After a failed QMP command, how long to wait for news of QEMU's end (its pidfd) before
# blaming the command: the socket closes as the process dies, its reaping comes just after.
ENDED_WAIT_S = 0.5


class QuietQMPClient(QMPClient):
    """A QMP client that formats a message for its debug log only when that log is on.
    qemu.qmp's own hooks (`_cb_outbound`, `_cb_inbound`: meant for subclasses) render every
    message as indented JSON before the logger can drop it: a restore sends and gets ~20,
    and that formatting was the largest single cost of a create left in our process (#23)."""

    def _cb_outbound(self, msg: Message) -> Message:
        if self.logger.isEnabledFor(logging.DEBUG):
            self.logger.debug("--> %s", msg)
        return msg

    def _cb_inbound(self, msg: Message) -> Message:
        if self.logger.isEnabledFor(logging.DEBUG):
            self.logger.debug("<-- %s", msg)
        return msg


class QemuBase:
    """A QEMU guest's state and its QMP channel; `qemu.QemuVM` is the whole driver."""

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
        on_exit: Callable[[Self], None] | None = None,
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
        self.serial_log = SandboxFiles(workdir).serial_log
        self.stderr_log = workdir / "qemu.stderr"
        sock = workdir / "qmp.sock"
        if len(str(sock)) > _MAX_SOCK_PATH:
            # A directory per VM: a confined QEMU sees that one, not every VM's socket.
            sock = (
                SOCK_FALLBACK_DIR / name / "qmp.sock"
                if confine
                else SOCK_FALLBACK_DIR / f"{name}.sock"
            )
        self.qmp_socket = sock
        # Where QEMU was told to listen; `relocate` moves the socket, not this.
        self.launch_socket = sock
        self.cgroup = Cgroup(name) if cgroup else None
        self.registry = registry
        self.on_exit: Callable[[Self], None] | None = on_exit
        # QEMU's PID (host view), watched through a pidfd that becomes readable when it ends;
        # its parent is this server's launcher, or another's for an adopted QEMU.
        self._pid: int | None = None
        self._adopted = False
        self._exit_code: int | None = None
        self._ended = asyncio.Event()
        self._status_task: asyncio.Task[None] | None = None
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

    @property
    def pid(self) -> int | None:
        """QEMU's PID."""
        return self._pid

    @property
    def exit_code(self) -> int | None:
        """QEMU's exit status once it has ended (also when nobody awaited it);
        `EXIT_UNKNOWN` for an adopted QEMU or one whose launcher did not say."""
        return self._exit_code

    @property
    def adopted(self) -> bool:
        return self._adopted

    def _in_vm(self, path: Path) -> Path:
        """The name QEMU knows a host path by (its root has the workdir where it was)."""
        if path.is_relative_to(self.workdir):
            return self.launch_workdir / path.relative_to(self.workdir)
        return path

    def _from_vm(self, path: Path) -> Path:
        if path.is_relative_to(self.launch_workdir):
            return self.workdir / path.relative_to(self.launch_workdir)
        return path

    def spec(self) -> dict[str, Any]:
        """What this VM is built from, as JSON values (the registry record's `spec`)."""
        return {
            "machine": _plain(self.machine),
            "boot": _plain(self.boot),
            "drives": [_plain(d) for d in self.drives],
            "net": _plain(self.net),
            "netns": self.netns,
            "cgroup": self.cgroup is not None,
            "qemu_binary": self.qemu_binary,
            "incoming": self.incoming,
            "ram_shim": None if self.ram_shim is None else str(self.ram_shim),
            "confine": self.confine,
            "launch_workdir": str(self.launch_workdir),
            "disk_limits": _plain(self.disk_limits),
        }

    def _record(self, spec: dict[str, Any] | None = None) -> vm_registry.VMRecord:
        pid = self.pid
        return vm_registry.VMRecord(
            name=self.name,
            workdir=str(self.workdir),
            qmp_socket=str(self.qmp_socket),
            launch_socket=str(self.launch_socket),
            pid=pid,
            starttime=None if pid is None else vm_registry.proc_starttime(pid),
            spec=self.spec() if spec is None else spec,
        )

    def _write_record(self, spec: dict[str, Any] | None = None) -> None:
        """`spec`: this VM's `spec()` when the caller has it (a start writes the record twice,
        before and after the spawn, from the same spec)."""
        if self.registry is not None:
            vm_registry.write(self.registry, self._record(spec))

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
            # A QEMU that died drops its QMP socket: say that, not the client's state. One
            # that answered with an error is alive: no wait.
            if self.pid is not None and not isinstance(exc, ExecuteError):
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(ENDED_WAIT_S):
                        await self._ended.wait()
            if self._ended.is_set():
                raise VMMError(
                    f"{self.name}: QEMU exited (status {self._exit_code}) during QMP {cmd}"
                ) from exc
            raise VMMError(f"{self.name}: QMP {cmd} failed: {exc}") from exc


def _plain(value: Any) -> Any:
    """A spec's dataclass (or a field of one) as JSON values: what `json.loads(json.dumps(
    asdict(value), default=str))` gave, without `asdict`'s deep copy of every leaf (~1 ms of
    a VM start's CPU)."""
    if is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in fields(value)}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if value is None or type(value) in (bool, int, float, str):
        return value
    return str(value)
