"""Errors of `Node`: one base class, one line of message each, raised before anything is made
when the input is at fault."""

from __future__ import annotations


class SandboxError(Exception):
    """A sandbox could not be created, found or removed."""


class UnknownTemplate(SandboxError):
    pass


class InvalidResources(SandboxError):
    """cpu, memory or disk outside what this node allows."""


class MemoryOutOfRange(InvalidResources):
    pass


class CpuOutOfRange(InvalidResources):
    pass


class DiskTooSmallForTemplate(InvalidResources):
    pass


class UnknownSandbox(SandboxError):
    pass


class BootFailed(SandboxError):
    """The VM did not get to a healthy envd; everything it held was released."""


class NotPausable(SandboxError):
    """The sandbox cannot be paused or snapshotted (booted without snapshot support)."""


class SandboxPaused(SandboxError):
    """The operation needs a running sandbox and this one is paused."""


class SandboxNotPaused(SandboxError):
    """Resume of a sandbox that is running."""


class NoCapacity(SandboxError):
    """The node cannot take this start now: a limit (sandboxes, host memory, disk, network
    slots) or a full start queue. Raised before anything is allocated. `resource` names what
    ran out; `retry_after_s` is when trying again may help."""

    def __init__(self, message: str, *, resource: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.resource = resource
        self.retry_after_s = retry_after_s


class ResetLost(SandboxError):
    """A reset failed after the sandbox's old guest was stopped: the sandbox is gone (its
    stack ran). Any other error of a reset was raised before anything changed."""


class NotResettable(SandboxError):
    """The sandbox cannot be reset in place here (no memory snapshot of the target, a paused
    sandbox): the caller replaces it by a delete and a create."""
