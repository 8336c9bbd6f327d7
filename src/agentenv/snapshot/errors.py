"""Snapshot errors: each is one line that says what is wrong with which snapshot."""

from __future__ import annotations


class SnapshotError(Exception):
    """Base class of snapshot failures."""


class SnapshotNotFound(SnapshotError):
    """No snapshot has that id or name."""


class IncompatibleSnapshot(SnapshotError):
    """The snapshot needs a QEMU, accelerator or tools layer this host does not have."""


class CaptureFailed(SnapshotError):
    """Saving a guest's memory, device state or disk did not complete."""


class RestoreFailed(SnapshotError):
    """A guest could not be brought back from a snapshot or a paused state."""


class InvalidSnapshotName(SnapshotError):
    """A snapshot name is not usable as a template name."""


class ResumedButLost(RestoreFailed):
    """A resumed guest ran and then failed: its paused state is gone, nothing can bring it
    back."""
