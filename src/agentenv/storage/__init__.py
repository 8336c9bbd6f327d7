"""Disk layers: a content-addressed store of read-only qcow2 layers and per-sandbox uppers."""

from agentenv.storage.errors import (
    DiskTooSmall,
    ImageError,
    LayerInUse,
    LayerNotFound,
    StorageError,
)
from agentenv.storage.images import ImageInfo, create_upper, create_upper_sync, info
from agentenv.storage.layers import LayerStore

__all__ = [
    "DiskTooSmall",
    "ImageError",
    "ImageInfo",
    "LayerInUse",
    "LayerNotFound",
    "LayerStore",
    "StorageError",
    "create_upper",
    "create_upper_sync",
    "info",
]
