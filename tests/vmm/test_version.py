"""What a QEMU version changes in the arguments agentenv gives it."""

from __future__ import annotations

from agentenv.vmm.version import UNKNOWN, QemuVersion, microvm_machine, parse_version


def test_parses_debian_version_lines() -> None:
    assert parse_version("QEMU emulator version 7.2.22 (Debian 1:7.2+dfsg-7+deb12u18+b3)") == (
        7,
        2,
        22,
    )
    assert str(parse_version("QEMU emulator version 10.0.2 (Debian 1:10.0.2+ds-2)")) == "10.0.2"
    assert parse_version("not qemu") == UNKNOWN


def test_option_roms_stay_on_where_the_kernel_needs_them() -> None:
    assert "x-option-roms=off" in microvm_machine(QemuVersion(7, 2, 22))
    assert "x-option-roms" not in microvm_machine(QemuVersion(10, 0, 2))
    assert "x-option-roms" not in microvm_machine(UNKNOWN)
    for v in (QemuVersion(7, 2, 22), QemuVersion(10, 0, 2)):
        assert microvm_machine(v).endswith("pit=off,pic=off,rtc=on")
