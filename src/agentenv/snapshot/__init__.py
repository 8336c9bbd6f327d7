"""Snapshots: templates are snapshots, sandboxes are restores, pause/resume, fork.

- `repository.SnapshotRepository` (a `SnapshotStore`): immutable, content-addressed snapshots
  (RAM image, device state, layer digests) with a catalog of names and holders.
- `templates.ensure_template_snapshot`: boot a template once and capture it (cached).
- `restore.restore`: a new guest from a snapshot (private copy-on-write RAM, fresh upper);
  `identity.identify` then gives it its hostname, clock and RNG seed.
- `capture.capture`: a running guest into a snapshot, optionally keeping it running.
- `pause.pause` / `pause.resume`: a sandbox out of and back into a QEMU, state in its workdir.
- `fork.fork`: one capture, N restored children.
"""

from agentenv.snapshot.capture import Capture, capture
from agentenv.snapshot.errors import (
    CaptureFailed,
    IncompatibleSnapshot,
    InvalidSnapshotName,
    RestoreFailed,
    ResumedButLost,
    SnapshotError,
    SnapshotNotFound,
)
from agentenv.snapshot.fork import ForkResult, ForkTarget, fork
from agentenv.snapshot.identity import identify
from agentenv.snapshot.machine import GuestImage, Machine, MemoryMode
from agentenv.snapshot.model import Snapshot
from agentenv.snapshot.pause import PausedState, pause, paused_state, resume
from agentenv.snapshot.repository import SnapshotRepository, SnapshotStore
from agentenv.snapshot.restore import release, restore
from agentenv.snapshot.templates import (
    ensure_template_snapshot,
    find_template_snapshot,
    repository,
    template_alias,
)

__all__ = [
    "Capture",
    "CaptureFailed",
    "ForkResult",
    "ForkTarget",
    "GuestImage",
    "IncompatibleSnapshot",
    "InvalidSnapshotName",
    "Machine",
    "MemoryMode",
    "PausedState",
    "RestoreFailed",
    "ResumedButLost",
    "Snapshot",
    "SnapshotError",
    "SnapshotNotFound",
    "SnapshotRepository",
    "SnapshotStore",
    "capture",
    "ensure_template_snapshot",
    "find_template_snapshot",
    "fork",
    "identify",
    "pause",
    "paused_state",
    "release",
    "repository",
    "restore",
    "resume",
    "template_alias",
]
