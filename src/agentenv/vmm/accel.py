"""Choose how guests run: KVM, PVM or TCG software emulation, and say why.

- kvm: /dev/kvm opens, the CPU advertises vmx/svm, and the loaded KVM is not PVM.
- pvm: the host runs kvm_pvm and the operator supplied a PVM guest kernel.
- tcg: anything else. It works everywhere but guests are several times slower, and
  emulation is not the isolation boundary that hardware virtualisation is.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from agentenv.config import Settings
from agentenv.vmm.errors import AccelUnavailable

# TCG translates guest code into a cache that defaults to 1 GiB per VM. Ours is
# `Settings.tcg_tb_size_mb` (AGENTENV_TCG_TB_SIZE_MB): it grows only as a guest runs new code,
# so an idle clone holds the same either way, and a guest that fills it pays for a flush and
# a translation of everything again (docs/vmm.md has the measured trade).
# What the VM's memory ceiling (`vmm.qemu`) and admission's overhead (`node.admission`)
# already count for the code cache; a larger cache adds `AccelChoice.code_cache_extra_mb`.
CODE_CACHE_COUNTED_MB = 64
# Under TCG the kernel cannot calibrate its TSC against a real timer (see microvm-notes §1-2).
TCG_TSC_KHZ = 2_100_000
# How long a cold boot may take until envd answers (`Settings.boot_timeout_s` overrides it).
# A template's start hooks run inside it (a code-interpreter build's warmed python kernel),
# and under TCG every step of the guest takes several times longer, more on a loaded host: with
# KVM's 120 s a first-use code-interpreter build under three concurrent test workers overran
# in 2 of 6 runs. So TCG gets three times as long.
BOOT_TIMEOUT_S = 120.0
TCG_BOOT_TIMEOUT_S = 3 * BOOT_TIMEOUT_S


@dataclass(frozen=True)
class AccelChoice:
    name: str
    reason: str
    warnings: list[str] = field(default_factory=list)
    qemu_args: list[str] = field(default_factory=list)
    # Host memory a VM may fill with translated code (TCG only), on top of QEMU's own.
    code_cache_mb: int = 0
    # Extra kernel command-line words this accelerator needs.
    cmdline: list[str] = field(default_factory=list)
    # One line per prerequisite that would enable a faster accelerator.
    fixes: list[str] = field(default_factory=list)
    # A cold boot's deadline unless the settings name one (`boot_deadline`).
    boot_timeout_s: float = BOOT_TIMEOUT_S

    @property
    def code_cache_extra_mb(self) -> int:
        """The code cache beyond what memory ceilings and estimates already count."""
        return max(0, self.code_cache_mb - CODE_CACHE_COUNTED_MB)


@dataclass(frozen=True)
class HostFacts:
    """What the choice depends on; read from the host, or built by hand in tests."""

    kvm_device: bool
    kvm_error: str
    pvm_module: bool
    hw_virt: bool

    @classmethod
    def probe(cls, dev: Path = Path("/dev/kvm"), sys: Path = Path("/sys")) -> HostFacts:
        ok, err = False, ""
        try:
            os.close(os.open(dev, os.O_RDWR | os.O_CLOEXEC))
            ok = True
        except OSError as exc:
            err = exc.strerror or str(exc)
        flags: set[str] = set()
        try:
            for line in Path("/proc/cpuinfo").read_text().splitlines():
                if line.startswith("flags"):
                    flags.update(line.split(":", 1)[1].split())
                    break
        except OSError:
            pass
        return cls(
            kvm_device=ok,
            kvm_error=err,
            pvm_module=(sys / "module" / "kvm_pvm").exists(),
            hw_virt=bool(flags & {"vmx", "svm"}),
        )


def _kvm(reason: str) -> AccelChoice:
    return AccelChoice("kvm", reason, qemu_args=["-accel", "kvm", "-cpu", "host"])


def _pvm(kernel: Path) -> AccelChoice:
    return AccelChoice(
        "pvm",
        f"kvm_pvm is loaded and the PVM guest kernel {kernel} is configured",
        qemu_args=["-accel", "kvm", "-cpu", "host"],
    )


def _tcg(reason: str, fixes: list[str], tb_size_mb: int) -> AccelChoice:
    return AccelChoice(
        "tcg",
        reason,
        warnings=[
            "guests run under TCG software emulation: several times slower than KVM, and "
            "emulation is a weaker isolation boundary than hardware virtualisation"
        ],
        qemu_args=["-accel", f"tcg,tb-size={tb_size_mb}", "-cpu", "max"],
        code_cache_mb=tb_size_mb,
        cmdline=[f"tsc_early_khz={TCG_TSC_KHZ}"],
        fixes=fixes,
        boot_timeout_s=TCG_BOOT_TIMEOUT_S,
    )


def choose(settings: Settings, facts: HostFacts) -> AccelChoice:
    kvm_ok = facts.kvm_device and facts.hw_virt and not facts.pvm_module
    pvm_kernel = settings.pvm_kernel
    pvm_ok = facts.pvm_module and facts.kvm_device and pvm_kernel is not None
    pvm_kernel_ok = pvm_kernel is not None and pvm_kernel.is_file()

    fixes: list[str] = []
    if facts.pvm_module:
        why = "/dev/kvm is PVM (kvm_pvm), which runs only PVM guest kernels"
        if pvm_kernel is None:
            fixes.append("set AGENTENV_PVM_KERNEL=<path to a CONFIG_PVM_GUEST vmlinux> to use PVM")
        elif not pvm_kernel_ok:
            fixes.append(f"AGENTENV_PVM_KERNEL={pvm_kernel} does not exist")
    elif not facts.kvm_device:
        why = f"/dev/kvm is not usable ({facts.kvm_error or 'missing'})"
        fixes.append("load kvm_intel or kvm_amd (modprobe) or enable nested virtualisation")
    else:
        why = "the CPU shows no vmx/svm flag"
        fixes.append("enable VT-x/AMD-V in firmware, or nested virtualisation on the VM host")

    forced = settings.accel
    if forced == "kvm":
        if not kvm_ok:
            raise AccelUnavailable(f"AGENTENV_ACCEL=kvm but {why}")
        return _kvm("forced by AGENTENV_ACCEL=kvm")
    if forced == "pvm":
        if not (pvm_ok and pvm_kernel_ok):
            need = "kvm_pvm is not loaded" if not facts.pvm_module else "no PVM guest kernel"
            raise AccelUnavailable(f"AGENTENV_ACCEL=pvm but {need}")
        assert pvm_kernel is not None
        return _pvm(pvm_kernel)
    if forced == "tcg":
        return _tcg("forced by AGENTENV_ACCEL=tcg", [], settings.tcg_tb_size_mb)
    if forced is not None:
        raise AccelUnavailable(f"unknown accelerator {forced!r}: expected kvm, pvm or tcg")

    if kvm_ok:
        return _kvm("/dev/kvm works and the CPU has hardware virtualisation")
    if pvm_ok and pvm_kernel_ok:
        assert pvm_kernel is not None
        return _pvm(pvm_kernel)
    return _tcg(f"{why}; falling back to software emulation", fixes, settings.tcg_tb_size_mb)


def boot_deadline(settings: Settings, accel: AccelChoice) -> float:
    """Seconds a cold boot may take until envd answers: AGENTENV_BOOT_TIMEOUT if set, else the
    accelerator's own."""
    if settings.boot_timeout_s is not None:
        return settings.boot_timeout_s
    return accel.boot_timeout_s


def detect(settings: Settings) -> AccelChoice:
    return choose(settings, HostFacts.probe())
