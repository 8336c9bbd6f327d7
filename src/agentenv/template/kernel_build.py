"""Building our own minimal microVM kernel (`aenv kernel build`): compiled from Debian's kernel
source with `files/microvm.config`, checked for the options the boot chain needs, and test-booted
with the tools image before it is published to the cache (where `kernel.find_custom` finds it).
Apart from `kernel` because the test boot needs the whole guest (`artifacts`, `tools`), which in
turn needs `kernel`.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from pathlib import Path

from agentenv import hostdeps
from agentenv.config import Settings
from agentenv.template import debian
from agentenv.template.artifacts import NO_INITRAMFS_CMDLINE, GuestArtifacts, kernel_cmdline
from agentenv.template.cache import ArtifactCache
from agentenv.template.commands import run
from agentenv.template.errors import BuildError
from agentenv.template.kernel import (
    CUSTOM_CONFIG,
    CUSTOM_SOURCE_PACKAGE,
    _single,
    custom_kernel_inputs,
    has_pvh_note,
)
from agentenv.template.progress import ProgressFn, report
from agentenv.template.smoke import smoke_boot
from agentenv.template.tools import ensure_tools_image


def build_custom(settings: Settings, progress: ProgressFn | None = None) -> Path:
    """Compile our minimal microVM kernel from Debian's kernel source; return its vmlinux.

    Everything is built in (no modules, no initramfs needed). Takes ~10 minutes on 2 cores;
    a second call with the same source, config and compiler is a cache hit.
    """
    hostdeps.ensure_host_packages(progress, extra=hostdeps.KERNEL_BUILD_PACKAGES)
    version = debian.installed_version(CUSTOM_SOURCE_PACKAGE)
    if version is None:
        raise BuildError(f"{CUSTOM_SOURCE_PACKAGE} is not installed")
    inputs = custom_kernel_inputs(version)
    tarballs = sorted(Path("/usr/src").glob(f"{CUSTOM_SOURCE_PACKAGE}.tar.*"))
    tarball = _single(tarballs, f"/usr/src/{CUSTOM_SOURCE_PACKAGE}.tar.*")

    def build(out: Path) -> None:
        with tempfile.TemporaryDirectory(dir=settings.cache, prefix=".kbuild-") as scratch:
            report(progress, f"unpacking {tarball.name}")
            run(["tar", "-xf", tarball, "-C", scratch], timeout=1800)
            src = _single([p for p in Path(scratch).iterdir() if p.is_dir()], "source tree")
            report(progress, "configuring the microVM kernel")
            run(["make", "-C", src, "tinyconfig"])
            run(
                [
                    src / "scripts/kconfig/merge_config.sh",
                    "-m",
                    "-O",
                    src,
                    src / ".config",
                    CUSTOM_CONFIG,
                ],
                cwd=src,
            )
            run(["make", "-C", src, "olddefconfig"])
            _check_config(src / ".config")
            jobs = str(os.cpu_count() or 1)
            report(progress, f"compiling the kernel (make -j{jobs} vmlinux, ~10 min)")
            run(["nice", "-n", "19", "make", "-C", src, f"-j{jobs}", "vmlinux"], timeout=4 * 3600)
            vmlinux = (src / "vmlinux").read_bytes()
            if not has_pvh_note(vmlinux):
                raise BuildError("built vmlinux has no PVH entry note (CONFIG_PVH missing?)")
            (out / "vmlinux").write_bytes(vmlinux)
            shutil.copy2(src / ".config", out / "config")
            (out / "dropped-options").write_text(
                "".join(f"{o}\n" for o in dropped_options(src / ".config"))
            )
            release = run(["make", "-s", "-C", src, "kernelrelease"]).strip()
            (out / "release").write_text(release + "\n")
        # Once published it is preferred over Debian's kernel, so it must boot first.
        report(progress, "test-booting the new kernel")
        seconds = _smoke(settings, out / "vmlinux", progress)
        report(progress, f"the new kernel reached the guest init in {seconds:.1f}s")

    path, _ = ArtifactCache(settings.cache).ensure("kernel-custom", inputs, build)
    return path / "vmlinux"


def _smoke(settings: Settings, vmlinux: Path, progress: ProgressFn | None) -> float:
    tools = ensure_tools_image(settings, progress)
    arts = GuestArtifacts(vmlinux, None, tools, "custom", list(NO_INITRAMFS_CMDLINE))
    return smoke_boot(settings, vmlinux, None, tools, kernel_cmdline(arts, "tcg"))


def dropped_options(config: Path) -> list[str]:
    """Options our fragment sets to y that Kconfig left out (unmet dependencies)."""
    have = "\n" + config.read_text()
    missing = []
    for line in CUSTOM_CONFIG.read_text().splitlines():
        m = re.match(r"^(CONFIG_\w+)=y$", line.strip())
        if m and f"\n{m.group(1)}=y" not in have:
            missing.append(m.group(1))
    return missing


def _check_config(config: Path) -> None:
    """Fail if an option the boot chain depends on was dropped by Kconfig."""
    missing = dropped_options(config)
    essential = {
        "CONFIG_PVH",
        "CONFIG_VIRTIO_MMIO",
        "CONFIG_VIRTIO_BLK",
        "CONFIG_EXT4_FS",
        "CONFIG_VIRTIO_NET",
        "CONFIG_DEVTMPFS",
        "CONFIG_ACPI",
        "CONFIG_PCI",
    }
    lost = sorted(essential.intersection(missing))
    if lost:
        raise BuildError(f"kernel config lost essential options: {', '.join(lost)}")
