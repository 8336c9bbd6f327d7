"""Where a node keeps a sandbox's files: `SandboxFiles` names every path of one sandbox's
workdir, and `sandbox_files`/`snapshots_dir` say where those dirs live under the data dir.
Node code asks these for a path instead of joining names itself."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from agentenv.config import Settings
from agentenv.snapshot.machine import MEMORY
from agentenv.snapshot.pause import PAUSED
from agentenv.snapshot.templates import snapshots_dir

__all__ = ["META", "ROOTFS", "SandboxFiles", "sandbox_files", "snapshots_dir"]

# The sandbox's copy-on-write disk over its template's layers.
ROOTFS = "rootfs.qcow2"
# What a paused sandbox needs besides `snapshot.pause`'s record to come back as a handle.
META = "sandbox.json"
SERIAL_LOG = "serial.log"


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

    @property
    def memory(self) -> Path:
        """The guest RAM file (`snapshot.machine.MEMORY`)."""
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
