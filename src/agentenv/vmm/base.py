"""The VMM interface: what the orchestrator needs from a virtual machine monitor.

The shapes follow what both QEMU microvm and Firecracker can do (a kernel boot source,
virtio block drives, one tap-backed NIC, a balloon, snapshots), so a Firecracker driver can
implement this protocol later without changes above it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol


@dataclass(frozen=True)
class BootSource:
    kernel: Path
    initrd: Path | None
    cmdline: str


@dataclass(frozen=True)
class Drive:
    """A virtio block device; the guest sees drives as vda, vdb, ... in list order."""

    id: str
    path: Path
    read_only: bool
    fmt: str = "qcow2"


@dataclass(frozen=True)
class NetIface:
    tap: str
    mac: str
    # A NIC whose tap lives in a throwaway network namespace of the VM's own: the guest sees
    # the same device, nothing reaches it. For a VM that only converts a snapshot.
    detached: bool = False


@dataclass(frozen=True)
class MachineSpec:
    vcpus: int
    memory_mb: int
    # Guest RAM in this file so a snapshot needs no copy of it. Shared: the guest writes into
    # the file (the VM that will be snapshotted). Private: copy-on-write over the file (a clone
    # restored from it; the file is never written).
    mem_file: Path | None = None
    mem_shared: bool = True
    balloon: bool = True


@dataclass(frozen=True)
class DiskLimits:
    """Host IO one writable drive may use, reads and writes together; 0 = no limit. The
    VMM enforces it on the device, so it holds whatever disk chain is behind the device."""

    bytes_per_s: int = 0
    iops: int = 0

    @classmethod
    def of(cls, mib_per_s: int, iops: int) -> DiskLimits | None:
        """From settings (MiB/s, requests/s); None when both are off."""
        if mib_per_s <= 0 and iops <= 0:
            return None
        return cls(max(0, mib_per_s) * 1024 * 1024, max(0, iops))


class VMStatus(enum.Enum):
    CREATED = "created"
    RUNNING = "running"
    PAUSED = "paused"
    STOPPED = "stopped"


class VMM(Protocol):
    """One guest. `start()` returns once the monitor answers (not when the guest is up)."""

    @property
    def pid(self) -> int | None: ...

    async def start(self) -> None: ...

    async def wait_exit(self) -> int:
        """Wait for the VMM process to end; returns its exit status."""
        ...

    async def stop(self, grace_s: float = 5.0) -> None:
        """Ask the guest to power off; kill it if it has not within `grace_s` seconds."""
        ...

    async def kill(self) -> None: ...

    async def pause(self) -> None: ...

    async def resume(self) -> None: ...

    async def status(self) -> VMStatus: ...

    async def seal_disk(self, drive_id: str, new_upper: Path) -> Path:
        """Make the drive's current upper read-only and send writes to `new_upper` (a fresh
        qcow2 created over it); returns the path of the now read-only layer."""
        ...

    async def snapshot_create(self, state_path: Path) -> None:
        """Pause the guest and write its device state to `state_path`; RAM stays in
        `mem_file`. The VM is left paused."""
        ...

    async def snapshot_load(self, state_path: Path, *, run: bool = True) -> None:
        """On a VM started to receive a snapshot: load the device state and run (or stay
        paused when `run` is false)."""
        ...

    async def stream_save(self, stream_path: Path) -> None:
        """Pause the guest and write RAM and device state to `stream_path` (for guests whose
        RAM is not in a shared file). The VM is left paused."""
        ...

    async def stream_load(self, stream_path: Path, *, run: bool = True) -> None:
        """On a VM started to receive a snapshot: load RAM and device state from a stream
        written by `stream_save`, then run (or stay paused)."""
        ...

    @property
    def balloon_reclaims(self) -> bool:
        """Whether inflating the balloon is safe and returns memory to the host."""
        ...

    async def balloon_set(self, target_bytes: int) -> None:
        """Ask the guest to shrink to (or grow back to) `target_bytes` of RAM; returns once
        asked, not when the guest got there."""
        ...

    async def balloon_query(self) -> int:
        """Bytes of RAM the guest holds now (memory size minus the balloon)."""
        ...
