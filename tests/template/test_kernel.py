"""Debian cloud kernel extraction and the initramfs built for it."""

from __future__ import annotations

import subprocess
from dataclasses import replace

import pytest

from agentenv.config import Settings
from agentenv.template.artifacts import NO_INITRAMFS_CMDLINE, GuestArtifacts, kernel_cmdline
from agentenv.template.errors import BuildError
from agentenv.template.initramfs import ensure_initramfs
from agentenv.template.kernel import (
    LZ4_LEGACY_MAGIC,
    ensure_debian_kernel,
    extract_vmlinux,
    find_custom,
    has_pvh_note,
)
from agentenv.template.smoke import smoke_boot
from agentenv.template.tools import ensure_tools_image


@pytest.fixture
def debian_artifacts(settings: Settings) -> GuestArtifacts:
    """Debian's kernel and our initramfs, whichever kernel ensure_all would pick."""
    kernel = ensure_debian_kernel(settings)
    return GuestArtifacts(
        kernel.vmlinux,
        ensure_initramfs(settings, kernel),
        ensure_tools_image(settings),
        "debian-cloud",
    )


def test_debian_kernel_is_a_pvh_elf_with_virtio_modules(settings: Settings) -> None:
    kernel = ensure_debian_kernel(settings)
    head = kernel.vmlinux.read_bytes()
    assert has_pvh_note(head)
    assert kernel.modules_dir is not None
    order = (kernel.modules_dir / "order").read_text().split()
    assert order.index("virtio_ring") < order.index("virtio_mmio") < order.index("virtio_blk")
    assert order.index("failover") < order.index("net_failover") < order.index("virtio_net")
    for name in order:
        assert (kernel.modules_dir / f"{name}.ko").read_bytes()[:4] == b"\x7fELF"
    # ext4 must be built in: the initramfs does not load it.
    assert "CONFIG_EXT4_FS=y" in (kernel.vmlinux.parent / "config").read_text()


def test_garbage_is_not_a_kernel() -> None:
    with pytest.raises(BuildError, match="no LZ4 payload"):
        extract_vmlinux(b"MZ" + b"\0" * 4096)
    with pytest.raises(BuildError, match="not an ELF"):
        extract_vmlinux(b"MZ" + LZ4_LEGACY_MAGIC + b"\0" * 64)
    assert not has_pvh_note(b"\x7fELF" + b"\0" * 60)
    assert not has_pvh_note(b"\x7fELF\x02" + b"\xff" * 60)  # headers point past the end


def test_initramfs_holds_busybox_modules_and_init(debian_artifacts: GuestArtifacts) -> None:
    assert debian_artifacts.initramfs is not None
    listing = subprocess.run(
        ["cpio", "-it", "--quiet"],
        stdin=debian_artifacts.initramfs.open("rb"),
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    for entry in (
        "init",
        "bin/busybox",
        "dev/console",
        "modules/order",
        "modules/virtio_blk.ko",
        "tools",
    ):
        assert entry in listing
    # Uncompressed newc: gzip would cost ~1 s of boot under emulation.
    assert debian_artifacts.initramfs.read_bytes()[:6] == b"070701"


@pytest.mark.vm
def test_smoke_boot_accepts_a_good_kernel_and_rejects_a_broken_one(
    settings: Settings, debian_artifacts: GuestArtifacts
) -> None:
    arts = debian_artifacts
    seconds = smoke_boot(
        settings, arts.kernel, arts.initramfs, arts.tools_image, kernel_cmdline(arts, "tcg")
    )
    assert 0 < seconds < 180
    # Debian's kernel has virtio as modules: without its initramfs it cannot find any disk.
    broken = replace(arts, initramfs=None, cmdline_extra=list(NO_INITRAMFS_CMDLINE))
    with pytest.raises(BuildError, match="did not reach the guest init"):
        smoke_boot(
            settings,
            broken.kernel,
            None,
            broken.tools_image,
            kernel_cmdline(broken, "tcg"),
            timeout=90,
        )


@pytest.mark.vm
def test_custom_kernel_if_built_boots_without_initramfs(settings: Settings) -> None:
    custom = find_custom(settings)
    if custom is None:
        pytest.skip("no custom kernel in the cache (`aenv kernel build`)")
    assert custom.modules_dir is None and has_pvh_note(custom.vmlinux.read_bytes())
    tools = ensure_tools_image(settings)
    arts = GuestArtifacts(custom.vmlinux, None, tools, "custom", list(NO_INITRAMFS_CMDLINE))
    assert smoke_boot(settings, custom.vmlinux, None, tools, kernel_cmdline(arts, "tcg")) < 180
