"""`aenv doctor`: the accelerator choice with its reason, and each missing prerequisite as a
one-line fix."""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console

from agentenv.config import Settings

# (command, Debian package that provides it)
_TOOLS = [
    ("qemu-system-x86_64", "qemu-system-x86"),
    ("qemu-img", "qemu-utils"),
    ("ip", "iproute2"),
    ("nft", "nftables"),
    ("mkfs.ext4", "e2fsprogs"),
    ("debootstrap", "debootstrap"),
    ("lz4", "lz4"),
    ("cpio", "cpio"),
    ("cc", "gcc"),
]


@dataclass
class Finding:
    ok: bool
    what: str
    fix: str = ""


def _checks(settings: Settings) -> list[Finding]:
    found: list[Finding] = []
    found.append(
        Finding(os.geteuid() == 0, "running as root", "run aenv as root (netns, taps, cgroups)")
    )
    for command, package in _TOOLS:
        path = shutil.which(command)
        found.append(
            Finding(
                path is not None, f"{command}: {path or 'missing'}", f"apt-get install {package}"
            )
        )
    busybox = Path("/bin/busybox")
    found.append(Finding(busybox.exists(), "static busybox", "apt-get install busybox-static"))
    tun = Path("/dev/net/tun")
    found.append(Finding(tun.exists(), "/dev/net/tun", "modprobe tun"))
    for controller in ("memory", "cpu", "pids"):
        v1 = Path("/sys/fs/cgroup") / controller
        v2 = Path("/sys/fs/cgroup/cgroup.controllers")
        ok = v1.is_dir() or (v2.exists() and controller in v2.read_text().split())
        found.append(
            Finding(
                ok, f"cgroup controller {controller}", f"mount the {controller} cgroup controller"
            )
        )
    found.extend(_artifact_checks(settings))
    found.extend(_confinement_checks(settings))
    return found


def _confinement_checks(settings: Settings) -> list[Finding]:
    """Each piece a confined QEMU needs; a missing one fails VM starts unless confinement
    is off (then nothing is checked: `run_doctor` says it is off)."""
    if not settings.confine:
        return []
    from agentenv.vmm.confine import pieces

    return [
        Finding(
            p.ok,
            f"VMM confinement: {p.name}" + ("" if p.ok else f" ({p.detail})"),
            "install it, or set AGENTENV_CONFINE=off to run QEMU unconfined (as root)",
        )
        for p in pieces(settings.qemu_binary)
    ]


def confinement_summary(settings: Settings) -> str:
    from agentenv.vmm.confine import SANDBOX

    if not settings.confine:
        return (
            "VMM confinement: [red]off[/red] (AGENTENV_CONFINE=off): QEMU runs as root "
            "with the host's file system and no syscall filter"
        )
    return (
        "VMM confinement: [bold]on[/bold] — a uid per VM, its own mount namespace with a "
        "root of only its files and QEMU's own (binary, libraries, firmware, modules), "
        f"seccomp (-sandbox {SANDBOX})"
    )


def network_summary(settings: Settings) -> str:
    """The per-slot limits in effect (`network.slot`): a guest sends only as itself, at
    most this fast each way, with at most this many connections open."""
    net = settings.network
    rate = f"{net.rate_mbit} Mbit/s each way" if net.rate_mbit else "[red]no rate limit[/red]"
    conns = (
        f"at most {net.max_connections} connections"
        if net.max_connections
        else "[red]no connection cap[/red]"
    )
    return (
        f"network per sandbox: {rate} (AGENTENV_NET_RATE_MBIT), {conns} "
        "(AGENTENV_SLOT_MAX_CONNECTIONS), anti-spoofing guard on its tap"
    )


def disk_summary(settings: Settings) -> str:
    """The per-sandbox disk IO limits in effect (QEMU block throttling on each writable
    drive)."""
    bps = f"{settings.disk_bps_mb} MiB/s" if settings.disk_bps_mb else "[red]no byte limit[/red]"
    iops = f"{settings.disk_iops} IO/s" if settings.disk_iops else "[red]no IO/s limit[/red]"
    return (
        f"disk IO per sandbox: {bps} (AGENTENV_DISK_BPS_MB), {iops} (AGENTENV_DISK_IOPS), "
        "reads and writes together"
    )


def _artifact_checks(settings: Settings) -> list[Finding]:
    from agentenv.template.catalog import TemplateCatalog, TemplateNotFound
    from agentenv.vmm.ramshim import find_ram_shim

    shim = find_ram_shim(settings.cache)
    found = [
        Finding(
            shim is not None,
            f"RAM preload library for snapshot clones: {shim or 'not built'}",
            "run `aenv setup`",
        )
    ]
    try:
        template = TemplateCatalog(settings).get("base")
    except TemplateNotFound:
        return [*found, Finding(False, "template base", "run `aenv setup`")]
    return [*found, Finding(True, f"template base: {len(template.layers)} layer(s)")]


def run_doctor(settings: Settings, console: Console) -> int:
    from agentenv.vmm.accel import detect

    choice = detect(settings)
    console.print(f"accelerator: [bold]{choice.name}[/bold] — {choice.reason}")
    for warning in choice.warnings:
        console.print(f"[yellow]warning:[/yellow] {warning}")
    console.print(f"data dir: {settings.home}   build cache: {settings.cache}")
    console.print(confinement_summary(settings), highlight=False)
    console.print(network_summary(settings), highlight=False)
    console.print(disk_summary(settings), highlight=False)
    missing = 0
    for finding in _checks(settings):
        if finding.ok:
            console.print(f"  [green]ok[/green]   {finding.what}", highlight=False)
        else:
            missing += 1
            console.print(f"  [red]fix[/red]  {finding.what}: {finding.fix}", highlight=False)
    if missing:
        console.print(f"{missing} prerequisite(s) missing; `aenv setup` installs and builds them.")
        return 1
    console.print("all prerequisites present")
    return 0
