"""A node's value types (what a sandbox is, what its guest gets at init, what every VM
boots from), its constants, and small file helpers. Split from `host.py`."""

from __future__ import annotations

import asyncio
import fcntl
import json
import logging
import os
import secrets
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from agentenv.cleanup import Cleanup
from agentenv.network import OPEN, Egress, Slot
from agentenv.node.errors import (
    SandboxError,
)
from agentenv.node.files import SandboxFiles
from agentenv.ports import ENVD_PORT
from agentenv.snapshot import Machine
from agentenv.template.catalog import Template
from agentenv.vmm.qemu import QemuVM

log = logging.getLogger(__name__)


HEALTH_POLL_S = 0.1
HEALTH_REQUEST_TIMEOUT_S = 2.0
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
    # Everything it holds, last acquired first (`node.cleanup`): built by the create,
    # resume or fork that made it, run by delete.
    cleanup: Cleanup = field(default_factory=lambda: Cleanup(""), repr=False)

    def __post_init__(self) -> None:
        self.cleanup.owner = self.cleanup.owner or self.id

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
class Boot:
    """What every VM of this node boots from, resolved once at `start()`."""

    kernel: Path
    initrd: Path | None
    tools_image: Path
    cmdline: Callable[[str], str]


def defaults_of(meta: dict[str, object]) -> TemplateDefaults | None:
    """The template defaults a sandbox's ``sandbox.json`` recorded at create, if any."""
    d = meta.get("defaults")
    if not isinstance(d, dict):
        return None
    return TemplateDefaults(dict(d.get("env") or {}), d.get("user"), d.get("workdir"))


def meta_defaults(workdir: Path) -> TemplateDefaults | None:
    try:
        return defaults_of(json.loads(SandboxFiles(workdir).meta.read_text()))
    except (OSError, ValueError):
        return None


def replace_json(path: Path, value: object) -> None:
    """Write `path` whole or not at all (a crash never leaves half a file to recover from)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(value))
    os.replace(tmp, path)


def claim_data_dir(run_dir: Path) -> int | None:
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


def warm_root(warm_dir: Path) -> Path:
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


async def wait_readable(fd: int, timeout_s: float) -> None:
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


def tail(path: Path, lines: int = 3) -> str:
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return "(no console output)"
    return " | ".join(text[-lines:]) if text else "(no console output)"
