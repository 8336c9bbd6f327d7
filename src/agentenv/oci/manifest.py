"""Manifests and indexes (OCI and Docker v2 schema 2), parsed into typed descriptors.

Only what a pull needs is kept: the config and layer descriptors of an image manifest, and
the platform of each entry of an index (a Docker "manifest list" is the same shape). Docker's
schema 1 manifests (signed, pre-2017) are refused with their media type in the message.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from agentenv.oci.errors import (
    InvalidReference,
    PlatformNotFound,
    RegistryError,
    UnsupportedMediaType,
)
from agentenv.oci.reference import check_digest

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
DOCKER_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"
DOCKER_CONFIG = "application/vnd.docker.container.image.v1+json"

IMAGE_TYPES = (OCI_MANIFEST, DOCKER_MANIFEST)
INDEX_TYPES = (OCI_INDEX, DOCKER_LIST)
# The Accept header of a manifest request: every type we can use, nothing else.
ACCEPT = ", ".join((*IMAGE_TYPES, *INDEX_TYPES))

LAYER_TYPES = {
    "application/vnd.oci.image.layer.v1.tar": "tar",
    "application/vnd.oci.image.layer.v1.tar+gzip": "gzip",
    "application/vnd.oci.image.layer.v1.tar+zstd": "zstd",
    "application/vnd.oci.image.layer.nondistributable.v1.tar": "tar",
    "application/vnd.oci.image.layer.nondistributable.v1.tar+gzip": "gzip",
    "application/vnd.oci.image.layer.nondistributable.v1.tar+zstd": "zstd",
    "application/vnd.docker.image.rootfs.diff.tar.gzip": "gzip",
    "application/vnd.docker.image.rootfs.foreign.diff.tar.gzip": "gzip",
}


@dataclass(frozen=True)
class Platform:
    os: str
    architecture: str
    variant: str | None = None

    def __str__(self) -> str:
        return f"{self.os}/{self.architecture}" + (f"/{self.variant}" if self.variant else "")


LINUX_AMD64 = Platform("linux", "amd64")


@dataclass(frozen=True)
class Descriptor:
    media_type: str
    digest: str
    size: int
    platform: Platform | None = None
    annotations: dict[str, str] = field(default_factory=dict, compare=False)


@dataclass(frozen=True)
class ImageManifest:
    media_type: str
    config: Descriptor
    layers: tuple[Descriptor, ...]


@dataclass(frozen=True)
class ImageIndex:
    media_type: str
    manifests: tuple[Descriptor, ...]

    def select(self, platform: Platform = LINUX_AMD64) -> Descriptor:
        """The entry for `platform` (a missing variant matches any), else PlatformNotFound."""
        for d in self.manifests:
            p = d.platform
            if p is None or d.media_type not in IMAGE_TYPES:
                continue
            same = p.os == platform.os and p.architecture == platform.architecture
            if same and (platform.variant is None or p.variant in (None, platform.variant)):
                return d
        have = sorted({str(d.platform) for d in self.manifests if d.platform is not None})
        raise PlatformNotFound(
            f"the image index has no {platform} manifest (it has: {', '.join(have) or 'none'})"
        )


def _descriptor(raw: Any, where: str) -> Descriptor:
    if not isinstance(raw, dict):
        raise RegistryError(f"{where}: a descriptor is not an object")
    try:
        media_type = str(raw["mediaType"])
        digest = check_digest(str(raw["digest"]))
        size = int(raw["size"])
    except (KeyError, TypeError, ValueError, InvalidReference) as exc:
        raise RegistryError(f"{where}: bad descriptor ({exc})") from None
    if size < 0:
        raise RegistryError(f"{where}: descriptor {digest} has a negative size")
    platform = None
    if isinstance(raw.get("platform"), dict):
        p = raw["platform"]
        platform = Platform(str(p.get("os", "")), str(p.get("architecture", "")), p.get("variant"))
    ann = raw.get("annotations") or {}
    return Descriptor(media_type, digest, size, platform, {str(k): str(v) for k, v in ann.items()})


def parse(body: bytes, content_type: str | None, where: str) -> ImageManifest | ImageIndex:
    """Parse a manifest body; the media type comes from the body, else the Content-Type."""
    try:
        doc = json.loads(body)
    except ValueError as exc:
        raise RegistryError(f"{where}: manifest is not JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise RegistryError(f"{where}: manifest is not a JSON object")
    header_type = (content_type or "").split(";")[0].strip()
    media_type = str(doc.get("mediaType") or header_type)
    if not media_type:
        # OCI allows an absent mediaType; the shape tells which one it is.
        media_type = OCI_INDEX if "manifests" in doc else OCI_MANIFEST
    if media_type in INDEX_TYPES:
        entries = doc.get("manifests")
        if not isinstance(entries, list):
            raise RegistryError(f"{where}: index without a manifests list")
        return ImageIndex(media_type, tuple(_descriptor(e, where) for e in entries))
    if media_type in IMAGE_TYPES:
        layers = doc.get("layers")
        if not isinstance(layers, list):
            raise RegistryError(f"{where}: manifest without a layers list")
        parsed = tuple(_descriptor(e, where) for e in layers)
        for layer in parsed:
            if layer.media_type not in LAYER_TYPES:
                raise UnsupportedMediaType(
                    f"{where}: layer {layer.digest} has media type {layer.media_type!r}"
                )
        return ImageManifest(media_type, _descriptor(doc.get("config"), where), parsed)
    raise UnsupportedMediaType(f"{where}: manifest media type {media_type!r} is not supported")
