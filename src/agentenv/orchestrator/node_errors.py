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
