"""Snapshots: templates are snapshots, sandboxes are restores, pause/resume, fork.

- `repository.SnapshotRepository` (a `SnapshotStore`): immutable, content-addressed snapshots
  (RAM image, device state, layer digests) with a catalog of names and holders.
- `templates.ensure_template_snapshot`: boot a template once and capture it (cached).
- `restore.restore`: a new guest from a snapshot (private copy-on-write RAM, fresh upper);
  `identity.identify` then gives it its hostname, clock and RNG seed.
- `capture.capture`: a running guest into a snapshot, optionally keeping it running;
  `capture.capture_disk`: its disk only (a filesystem-only snapshot, whose creates boot).
- `pause.pause` / `pause.resume`: a sandbox out of and back into a QEMU, state in its workdir;
  `pause.pause_disk`: its disk only, resumed by a cold boot (`machine.boot`).
- `fork.fork`: one capture, N restored children; `fork.fork_paused`: the same from a paused
  sandbox's files (`paused_capture.capture_paused`), which stays paused.
"""

from agentenv.snapshot.capture import Capture, capture, capture_disk
from agentenv.snapshot.errors import (
    CaptureFailed,
    IncompatibleSnapshot,
    InvalidSnapshotName,
    RestoreFailed,
    ResumedButLost,
    SnapshotError,
    SnapshotNotFound,
)
from agentenv.snapshot.fork import ForkResult, ForkTarget, fork, fork_paused
from agentenv.snapshot.guestsync import GuestSyncFailed
from agentenv.snapshot.identity import identify
from agentenv.snapshot.machine import GuestImage, Machine, MemoryMode, boot, envd_url
from agentenv.snapshot.model import Snapshot
from agentenv.snapshot.pause import PausedState, pause, pause_disk, paused_state, resume
from agentenv.snapshot.paused_capture import NoMemory
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
    "GuestSyncFailed",
    "IncompatibleSnapshot",
    "InvalidSnapshotName",
    "Machine",
    "MemoryMode",
    "NoMemory",
    "PausedState",
    "RestoreFailed",
    "ResumedButLost",
    "Snapshot",
    "SnapshotError",
    "SnapshotNotFound",
    "SnapshotRepository",
    "SnapshotStore",
    "boot",
    "capture",
    "capture_disk",
    "ensure_template_snapshot",
    "envd_url",
    "find_template_snapshot",
    "fork",
    "fork_paused",
    "identify",
    "pause",
    "pause_disk",
    "paused_state",
    "release",
    "repository",
    "restore",
    "resume",
    "template_alias",
]
