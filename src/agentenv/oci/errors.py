"""Errors of the OCI client, the cache and layer application; each message names what failed."""

from __future__ import annotations


class OciError(Exception):
    """Anything that went wrong pulling or unpacking an image."""


class InvalidReference(OciError):
    """An image reference that does not parse (`[registry/]repo[:tag][@digest]`)."""


class RegistryError(OciError):
    """The registry answered something we cannot use (or could not be reached)."""


class ManifestUnknown(RegistryError):
    """The registry has no manifest for that tag or digest."""


class BlobUnknown(RegistryError):
    """The registry has no blob with that digest."""


class Unauthorized(RegistryError):
    """The registry refused our credentials (or we had none and it wants some)."""


class DigestMismatch(OciError):
    """Downloaded bytes do not hash to the digest that named them."""


class SizeMismatch(OciError):
    """A blob is longer or shorter than its descriptor says."""


class PlatformNotFound(OciError):
    """An image index has no manifest for the platform we run (linux/amd64)."""


class UnsupportedMediaType(OciError):
    """A manifest or layer type we do not understand."""


class LayerError(OciError):
    """A layer archive is malformed or tries to write outside the root."""


class CacheError(OciError):
    """The image cache could not do what was asked."""
