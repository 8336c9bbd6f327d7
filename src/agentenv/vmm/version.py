"""Which QEMU a binary is, and what that version changes in how agentenv drives it.

Measured between Debian's 7.2 (bookworm) and 10.0 (bookworm-backports): 7.2 boots a PVH
kernel on `-M microvm` with `x-option-roms=off`; 10.0 prints nothing to the serial port with it,
so newer versions keep the option ROMs. Device state only loads into the QEMU version that
saved it, so snapshots record the version (`str(version)`).
"""

from __future__ import annotations

import functools
import re
import subprocess
from typing import NamedTuple


class QemuVersion(NamedTuple):
    major: int
    minor: int
    micro: int

    def __str__(self) -> str:
        return f"{self.major}.{self.minor}.{self.micro}"

    @property
    def known(self) -> bool:
        return self.major > 0

    @property
    def needs_option_roms(self) -> bool:
        return self.major >= 8 or not self.known


UNKNOWN = QemuVersion(0, 0, 0)


def parse_version(text: str) -> QemuVersion:
    m = re.search(r"version (\d+)\.(\d+)\.(\d+)", text)
    if m is None:
        return UNKNOWN
    return QemuVersion(int(m.group(1)), int(m.group(2)), int(m.group(3)))


@functools.cache
def qemu_version(binary: str) -> QemuVersion:
    """The version a QEMU binary reports (UNKNOWN if it does not run)."""
    try:
        out = subprocess.run(
            [binary, "--version"], capture_output=True, text=True, check=False, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired):
        return UNKNOWN
    return parse_version(out.stdout)


def microvm_machine(version: QemuVersion) -> str:
    """The `-M` value for a guest: no legacy PIT/PIC (the kernel uses the LAPIC), an RTC for the
    wall clock at boot."""
    opts = "microvm"
    if not version.needs_option_roms:
        opts += ",x-option-roms=off"
    return opts + ",pit=off,pic=off,rtc=on"
