"""Errors raised by the storage layer; each carries a one-line message for the user."""

from __future__ import annotations


class StorageError(Exception):
    """A disk layer or image operation failed."""


class LayerNotFound(StorageError):
    """No layer with that digest is in the store."""


class LayerInUse(StorageError):
    """The layer is still referenced, so it cannot be removed."""


class DiskTooSmall(StorageError):
    """The requested disk is smaller than the image it must hold."""


class ImageError(StorageError):
    """qemu-img rejected an image or could not be run."""
