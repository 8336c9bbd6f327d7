"""Debian cloud kernel extraction and the initramfs built for it."""

from __future__ import annotations

import subprocess
from dataclasses import replace

import pytest

from agentenv.config import Settings
from agentenv.template.artifacts import GuestArtifacts
from agentenv.template.errors import BuildError
from agentenv.template.kernel import (
    LZ4_LEGACY_MAGIC,
    ensure_debian_kernel,
    extract_vmlinux,
    has_pvh_note,
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


def test_initramfs_holds_busybox_modules_and_init(guest_artifacts: GuestArtifacts) -> None:
    if guest_artifacts.initramfs is None:
        pytest.skip("the selected kernel boots without an initramfs")
    listing = subprocess.run(
        ["cpio", "-it", "--quiet"],
        stdin=guest_artifacts.initramfs.open("rb"),
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
    assert guest_artifacts.initramfs.read_bytes()[:6] == b"070701"


@pytest.mark.vm
def test_smoke_boot_accepts_a_good_kernel_and_rejects_a_broken_one(
    settings: Settings, guest_artifacts: GuestArtifacts
) -> None:
    from agentenv.template.artifacts import NO_INITRAMFS_CMDLINE, kernel_cmdline
    from agentenv.template.smoke import smoke_boot

    arts = guest_artifacts
    seconds = smoke_boot(
        settings, arts.kernel, arts.initramfs, arts.tools_image, kernel_cmdline(arts, "tcg")
    )
    assert 0 < seconds < 180
    if arts.initramfs is None:
        return
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
