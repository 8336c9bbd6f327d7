"""Accelerator choice: the real host, and every branch through explicit host facts."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from agentenv.config import Settings
from agentenv.vmm.accel import TCG_TB_SIZE_MB, AccelChoice, HostFacts, choose, detect
from agentenv.vmm.errors import AccelUnavailable

KVM = HostFacts(kvm_device=True, kvm_error="", pvm_module=False, hw_virt=True)
PVM = HostFacts(kvm_device=True, kvm_error="", pvm_module=True, hw_virt=False)
NONE = HostFacts(
    kvm_device=False, kvm_error="No such file or directory", pvm_module=False, hw_virt=False
)


def test_this_host(settings: Settings) -> None:
    choice = detect(replace(settings, accel=None, pvm_kernel=None))
    facts = HostFacts.probe()
    if facts.pvm_module:
        # The dev/CI machines: PVM without a guest kernel means software emulation.
        assert choice.name == "tcg"
        assert "PVM" in choice.reason
        assert any("AGENTENV_PVM_KERNEL" in f for f in choice.fixes)
    assert isinstance(choice, AccelChoice)
    assert choice.qemu_args[0] == "-accel"


def test_kvm_preferred(settings: Settings) -> None:
    c = choose(replace(settings, accel=None), KVM)
    assert c.name == "kvm" and c.qemu_args == ["-accel", "kvm", "-cpu", "host"]
    assert not c.warnings and not c.cmdline


def test_pvm_needs_a_guest_kernel(settings: Settings, tmp_path: Path) -> None:
    c = choose(replace(settings, accel=None, pvm_kernel=None), PVM)
    assert c.name == "tcg" and c.warnings and "tsc_early_khz=2100000" in c.cmdline
    kernel = tmp_path / "vmlinux-pvm"
    kernel.write_bytes(b"\x7fELF")
    c = choose(replace(settings, accel=None, pvm_kernel=kernel), PVM)
    assert c.name == "pvm"
    missing = tmp_path / "nope"
    c = choose(replace(settings, accel=None, pvm_kernel=missing), PVM)
    assert c.name == "tcg" and any("does not exist" in f for f in c.fixes)


def test_no_kvm_falls_back_loudly(settings: Settings) -> None:
    c = choose(replace(settings, accel=None), NONE)
    assert c.name == "tcg"
    assert "weaker isolation" in c.warnings[0]
    assert "/dev/kvm is not usable" in c.reason
    assert c.fixes


def test_forced_choices(settings: Settings) -> None:
    assert choose(replace(settings, accel="tcg"), KVM).name == "tcg"
    assert choose(replace(settings, accel="kvm"), KVM).name == "kvm"
    with pytest.raises(AccelUnavailable, match="AGENTENV_ACCEL=kvm"):
        choose(replace(settings, accel="kvm"), PVM)
    with pytest.raises(AccelUnavailable, match="no PVM guest kernel"):
        choose(replace(settings, accel="pvm", pvm_kernel=None), PVM)
    with pytest.raises(AccelUnavailable, match="unknown accelerator"):
        choose(replace(settings, accel="xen"), KVM)


def test_tcg_translation_cache_is_capped_and_kvm_has_none(settings: Settings) -> None:
    """The translation cache is most of a TCG clone's host memory (bench/memory.py): QEMU's
    default is 1 GiB, ours `TCG_TB_SIZE_MB`; below 32 MiB a guest's commands cost it 2-3x the
    CPU and 8 MiB did not bring envd up (docs/vmm.md). A TCG option: KVM gets no tb-size."""
    tcg = choose(replace(settings, accel="tcg"), KVM).qemu_args
    assert tcg[:2] == ["-accel", f"tcg,tb-size={TCG_TB_SIZE_MB}"]
    assert 32 <= TCG_TB_SIZE_MB <= 256
    assert not any("tb-size" in a for a in choose(replace(settings, accel=None), KVM).qemu_args)
