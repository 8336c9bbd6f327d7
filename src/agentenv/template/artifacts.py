"""Everything a sandbox boots from besides its rootfs: kernel, initramfs, tools layer.

Kernel choice, first match wins: a user-supplied kernel (``AGENTENV_KERNEL``, optionally with
``AGENTENV_INITRAMFS``) > our own minimal kernel if `aenv kernel build` has put one in the
cache > Debian's cloud kernel with our initramfs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from agentenv.config import Settings
from agentenv.template.errors import BuildError
from agentenv.template.initramfs import ensure_initramfs
from agentenv.template.kernel import ensure_debian_kernel, find_custom
from agentenv.template.progress import ProgressFn, report
from agentenv.template.tools import ensure_tools_image

# Measured fastest under emulation (docs: microvm-notes §2); panic=-1 turns a dead PID 1 into
# a reboot, which -no-reboot turns into a clean QEMU exit.
BASE_CMDLINE = [
    "console=ttyS0",
    "quiet",
    "loglevel=1",
    "mitigations=off",
    "nokaslr",
    "i8042.noaux",
    "i8042.nomux",
    "i8042.nopnp",
    "i8042.dumbkbd",
    "8250.nr_uarts=1",
    "random.trust_cpu=on",
    "rcupdate.rcu_expedited=1",
    "cryptomgr.notests",
    "audit=0",
    "nowatchdog",
    "noreplace-smp",
    "panic=-1",
]
TCG_CMDLINE = ["tsc_early_khz=2100000"]
# Without an initramfs the kernel mounts the tools layer itself and runs its /init.
NO_INITRAMFS_CMDLINE = ["root=/dev/vdb", "ro", "rootfstype=ext4", "init=/init"]


@dataclass(frozen=True)
class GuestArtifacts:
    kernel: Path
    initramfs: Path | None
    tools_image: Path
    kernel_kind: str  # "debian-cloud", "custom" or "user"
    cmdline_extra: list[str] = field(default_factory=list)


def ensure_all(settings: Settings, progress: ProgressFn | None = None) -> GuestArtifacts:
    """Build (or find in the cache) the kernel, initramfs and tools layer."""
    tools = ensure_tools_image(settings, progress)
    if settings.kernel is not None:
        return user_kernel(settings, tools)
    custom = find_custom(settings)
    if custom is not None:
        report(progress, "using the custom microVM kernel")
        return GuestArtifacts(custom.vmlinux, None, tools, "custom", list(NO_INITRAMFS_CMDLINE))
    kernel = ensure_debian_kernel(settings, progress)
    initramfs = ensure_initramfs(settings, kernel, progress)
    return GuestArtifacts(kernel.vmlinux, initramfs, tools, "debian-cloud", [])


def user_kernel(settings: Settings, tools: Path) -> GuestArtifacts:
    assert settings.kernel is not None
    if not settings.kernel.is_file():
        raise BuildError(f"AGENTENV_KERNEL={settings.kernel}: no such file")
    if settings.initramfs is not None and not settings.initramfs.is_file():
        raise BuildError(f"AGENTENV_INITRAMFS={settings.initramfs}: no such file")
    extra = [] if settings.initramfs is not None else list(NO_INITRAMFS_CMDLINE)
    return GuestArtifacts(settings.kernel, settings.initramfs, tools, "user", extra)


def kernel_cmdline(artifacts: GuestArtifacts, accel: str, extra: list[str] | None = None) -> str:
    """The full kernel command line; ``extra`` carries per-sandbox ``agentenv.*`` settings."""
    args = list(BASE_CMDLINE)
    if accel == "tcg":
        args += TCG_CMDLINE
    args += artifacts.cmdline_extra
    args += extra or []
    return " ".join(args)


def start_budget(boot_timeout_s: float) -> int:
    """Seconds the guest init gives a template's start hooks together: three quarters of the
    host's boot deadline, so envd, which starts after them, is still awaited (90 of KVM's
    120 s, 270 of TCG's 360)."""
    return max(1, int(boot_timeout_s * 3 / 4))


def guest_args(settings: Settings, boot_timeout_s: float, hostname: str | None = None) -> list[str]:
    """``agentenv.*`` kernel arguments that configure the guest's network, hostname and start
    hooks' budget (`start_budget` of the host's boot deadline). The guest's resolver is its
    gateway (`network.dns`), the same in every slot and on every host, so what a snapshot
    captured keeps working wherever it is restored."""
    net = settings.network
    args = [
        f"agentenv.ip={net.guest_ip}/{net.guest_cidr.prefixlen}",
        f"agentenv.gw={net.gateway_ip}",
    ]
    if hostname:
        args.append(f"agentenv.hostname={hostname}")
    args.append(f"agentenv.dns={net.gateway_ip}")
    args.append(f"agentenv.start_budget={start_budget(boot_timeout_s)}")
    return args
