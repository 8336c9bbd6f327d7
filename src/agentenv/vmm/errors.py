"""Errors of the VMM layer."""

from __future__ import annotations


class VMMError(Exception):
    """The virtual machine monitor could not do what was asked."""


class VMStartError(VMMError):
    """The VM process did not come up."""


class AccelUnavailable(VMMError):
    """The requested accelerator cannot run guests on this host."""


class BalloonUnsupported(VMMError):
    """The VM has no balloon device, or reclaiming through it would be unsafe."""
