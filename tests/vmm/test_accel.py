"""Accelerator choice: the real host, and every branch through explicit host facts."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from agentenv.config import Settings
from agentenv.config_env import ConfigError
from agentenv.node.admission import Limits
from agentenv.vmm.accel import AccelChoice, HostFacts, boot_deadline, choose, detect
from agentenv.vmm.base import MachineSpec
from agentenv.vmm.errors import AccelUnavailable
from agentenv.vmm.qemu import cgroup_limits

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
    """The translation cache is most of a busy TCG clone's host memory (bench/memory.py):
    QEMU's default is 1 GiB, ours `Settings.tcg_tb_size_mb`; below 32 MiB a guest's commands
    cost it 2-3x the CPU and 8 MiB did not bring envd up (docs/vmm.md). A TCG option: KVM gets
    no tb-size. The VM's cgroup ceiling and admission's overhead grow with the cache."""
    assert 32 <= settings.tcg_tb_size_mb <= 1024
    tcg = choose(replace(settings, accel="tcg", tcg_tb_size_mb=256), KVM)
    assert tcg.qemu_args[:2] == ["-accel", "tcg,tb-size=256"]
    assert tcg.code_cache_mb == 256
    kvm = choose(replace(settings, accel=None), KVM)
    assert not any("tb-size" in a for a in kvm.qemu_args)
    assert kvm.code_cache_mb == 0
    spec = MachineSpec(vcpus=1, memory_mb=512)
    assert cgroup_limits(spec, kvm).memory_bytes == (512 + 192) * 2**20
    assert cgroup_limits(spec, tcg).memory_bytes == (512 + 192 + 192) * 2**20
    tcg64 = choose(replace(settings, accel="tcg", tcg_tb_size_mb=64), KVM)
    assert cgroup_limits(spec, tcg64).memory_bytes == (512 + 192) * 2**20
    assert Limits().for_accel(kvm).overhead_mb == 128
    assert Limits().for_accel(tcg64).overhead_mb == 128
    assert Limits().for_accel(tcg).overhead_mb == 128 + 192


@pytest.mark.parametrize("raw", ["16", "2048", "big"])
def test_a_tb_size_out_of_range_is_refused(monkeypatch: pytest.MonkeyPatch, raw: str) -> None:
    monkeypatch.setenv("AGENTENV_TCG_TB_SIZE_MB", raw)
    with pytest.raises(ConfigError, match="AGENTENV_TCG_TB_SIZE_MB"):
        Settings.from_env()


def test_a_cold_boot_may_take_three_times_as_long_under_tcg(settings: Settings) -> None:
    auto = replace(settings, accel=None, pvm_kernel=None, boot_timeout_s=None)
    kvm, tcg = choose(auto, KVM), choose(auto, NONE)
    assert (kvm.name, tcg.name) == ("kvm", "tcg")
    assert (boot_deadline(auto, kvm), boot_deadline(auto, tcg)) == (120.0, 360.0)
    # AGENTENV_BOOT_TIMEOUT, when set, is the deadline whatever the accelerator.
    assert boot_deadline(replace(auto, boot_timeout_s=50.0), tcg) == 50.0
