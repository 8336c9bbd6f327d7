"""Debian cloud kernel extraction and the initramfs built for it."""

from __future__ import annotations

import subprocess

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
