"""Where a node keeps a sandbox's files: `SandboxFiles` names every path of one sandbox's
workdir, and `sandbox_files`/`snapshots_dir` say where those dirs live under the data dir.

It sits at the top of the package (it imports only settings) so every user may import it:
node/, snapshot/, vmm/, build/ and api/ ask it for a path instead of joining names themselves.
The names are what old homes hold on disk; crash recovery reads them, so they never change."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from agentenv.config import Settings

__all__ = [
    "MEMORY",
    "META",
    "PAUSED",
    "ROOTFS",
    "SERIAL_LOG",
    "SandboxFiles",
    "home_snapshots_dir",
    "sandbox_files",
    "snapshots_dir",
]

# The sandbox's copy-on-write disk over its template's layers.
ROOTFS = "rootfs.qcow2"
# What a paused sandbox needs besides `snapshot.pause`'s record to come back as a handle.
META = "sandbox.json"
# The guest RAM file of a running or paused sandbox.
MEMORY = "memory"
# `snapshot.pause`'s record; present while the sandbox is paused.
PAUSED = "paused.json"
SERIAL_LOG = "serial.log"
# The snapshot repository's dir under the data dir.
SNAPSHOTS = "snapshots"


@dataclass(frozen=True)
class SandboxFiles:
    """The paths of one sandbox's workdir (running, paused, or a fork child's)."""

    workdir: Path

    @property
    def id(self) -> str:
        return self.workdir.name

    @property
    def meta(self) -> Path:
        """`sandbox.json`: template, shape, egress and defaults, written at create."""
        return self.workdir / META

    @property
    def upper(self) -> Path:
        """The qcow2 upper a create makes (a capture may move on to `rootfs-N.qcow2`)."""
        return self.workdir / ROOTFS

    def next_upper(self) -> Path:
        """The upper a capture moves the sandbox on to: `rootfs-N.qcow2`, the first N free."""
        n = 1
        while (path := self.workdir / f"rootfs-{n}.qcow2").exists():
            n += 1
        return path

    @property
    def memory(self) -> Path:
        """The guest RAM file."""
        return self.workdir / MEMORY

    @property
    def serial_log(self) -> Path:
        return self.workdir / SERIAL_LOG

    @property
    def paused(self) -> Path:
        """`snapshot.pause`'s record; present while the sandbox is paused."""
        return self.workdir / PAUSED

    def file(self, name: str) -> Path:
        """Another file of the workdir, by the name its owning module gives it."""
        return self.workdir / name


def sandbox_files(settings: Settings, sandbox_id: str) -> SandboxFiles:
    """A sandbox's files under the node's data dir (`settings.sandboxes_dir`)."""
    return SandboxFiles(settings.sandboxes_dir / sandbox_id)


def home_snapshots_dir(home: Path) -> Path:
    """The snapshot repository's dir of a data dir given by path (a seed home, a test's)."""
    return home / SNAPSHOTS


def snapshots_dir(settings: Settings) -> Path:
    """The node's snapshot repository dir (templates' snapshots and named snapshots)."""
    return home_snapshots_dir(settings.home)
