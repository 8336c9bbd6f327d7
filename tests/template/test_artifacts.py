"""Kernel choice, the kernel command line, and cache hits for the whole artifact set."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import pytest

from agentenv.config import Settings
from agentenv.template.artifacts import (
    NO_INITRAMFS_CMDLINE,
    GuestArtifacts,
    ensure_all,
    guest_args,
    kernel_cmdline,
    start_budget,
)
from agentenv.template.errors import BuildError


def test_cmdline_depends_on_accel_and_boot_path(tmp_path: Path) -> None:
    with_initrd = GuestArtifacts(tmp_path / "k", tmp_path / "i", tmp_path / "t", "debian-cloud")
    tcg = kernel_cmdline(with_initrd, "tcg", ["agentenv.hostname=x"])
    kvm = kernel_cmdline(with_initrd, "kvm")
    assert "tsc_early_khz=2100000" in tcg.split() and "tsc_early_khz" not in kvm
    assert tcg.split()[-1] == "agentenv.hostname=x"
    assert "root=" not in tcg
    bare = GuestArtifacts(
        tmp_path / "k", None, tmp_path / "t", "custom", list(NO_INITRAMFS_CMDLINE)
    )
    assert "root=/dev/vdb" in kernel_cmdline(bare, "kvm").split()


def test_guest_args_follow_the_address_plan(settings: Settings) -> None:
    assert guest_args(replace(settings, dns=()), 120.0, hostname="sb1") == [
        "agentenv.ip=169.254.0.2/30",
        "agentenv.gw=169.254.0.1",
        "agentenv.hostname=sb1",
        "agentenv.dns=169.254.0.1",
        "agentenv.start_budget=90",
    ]
    # The guest's resolver is its gateway whatever the node's upstreams are: a snapshot's
    # command line (and so its template key) does not depend on the host's resolv.conf.
    with_dns = replace(settings, dns=("198.51.100.53", "127.0.0.1:5353"))
    assert guest_args(with_dns, 120.0) == guest_args(replace(settings, dns=()), 120.0)


def test_the_start_hooks_get_three_quarters_of_the_boot_deadline(settings: Settings) -> None:
    # envd starts after the hooks: the host must still be waiting for it.
    assert [start_budget(s) for s in (120.0, 360.0, 50.0, 1.0)] == [90, 270, 37, 1]
    assert guest_args(settings, 360.0)[-1] == "agentenv.start_budget=270"


def test_user_kernel_overrides_and_is_checked(settings: Settings, tmp_path: Path) -> None:
    kernel = tmp_path / "vmlinux"
    kernel.write_bytes(b"\x7fELF")
    arts = ensure_all(replace(settings, kernel=kernel))
    assert (arts.kernel, arts.initramfs, arts.kernel_kind) == (kernel, None, "user")
    assert arts.cmdline_extra == NO_INITRAMFS_CMDLINE
    initrd = tmp_path / "initrd"
    initrd.write_bytes(b"070701")
    arts = ensure_all(replace(settings, kernel=kernel, initramfs=initrd))
    assert arts.initramfs == initrd and arts.cmdline_extra == []
    with pytest.raises(BuildError, match=r"AGENTENV_KERNEL=.*no such file"):
        ensure_all(replace(settings, kernel=tmp_path / "missing"))
    with pytest.raises(BuildError, match="AGENTENV_INITRAMFS"):
        ensure_all(replace(settings, kernel=kernel, initramfs=tmp_path / "missing"))


def test_second_ensure_all_is_a_cache_hit(settings: Settings) -> None:
    first = ensure_all(settings)
    steps: list[str] = []
    t0 = time.monotonic()
    again = ensure_all(settings, lambda step, done, total: steps.append(step))
    assert again == first
    assert time.monotonic() - t0 < 10
    assert not [s for s in steps if "build" in s or "download" in s or "install" in s]
