"""Image references: ``[registry[:port]/]repository[:tag][@algorithm:hex]``.

The grammar is Docker's: the first path component names a registry only if it contains a
``.`` or a ``:`` or is ``localhost`` (so ``ubuntu`` and ``library/ubuntu`` are Docker Hub
repositories), Docker Hub repositories without a namespace live under ``library/``, and a
reference with neither tag nor digest means ``:latest``. Docker Hub's API is not served on
``docker.io`` itself but on ``registry-1.docker.io`` (`Reference.api_host`).
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass

from agentenv.oci.errors import InvalidReference

DOCKER_HUB = "docker.io"
DOCKER_HUB_API = "registry-1.docker.io"
DEFAULT_TAG = "latest"

_COMPONENT = re.compile(r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*")
_TAG = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}")
_DIGEST = re.compile(r"(sha256:[0-9a-f]{64}|sha512:[0-9a-f]{128})")
_HOST = re.compile(
    r"(?:[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?)*"
    r"|\[[0-9A-Fa-f:.]+\])(?::[0-9]{1,5})?"
)
MAX_NAME = 255


def check_digest(digest: str) -> str:
    """`digest` if it is ``sha256:<64 hex>`` (or sha512), else InvalidReference."""
    if not _DIGEST.fullmatch(digest):
        raise InvalidReference(f"{digest!r} is not a digest (want sha256:<64 hex digits>)")
    return digest


@dataclass(frozen=True)
class Reference:
    registry: str
    repository: str
    tag: str | None = None
    digest: str | None = None

    @property
    def api_host(self) -> str:
        """Host[:port] the distribution API is served on."""
        return DOCKER_HUB_API if self.registry == DOCKER_HUB else self.registry

    @property
    def host(self) -> str:
        """The registry's host name or address without port and brackets."""
        reg = self.registry
        if reg.startswith("["):
            return reg[1 : reg.index("]")]
        return reg.rsplit(":", 1)[0] if ":" in reg else reg

    @property
    def is_loopback(self) -> bool:
        if self.host == "localhost":
            return True
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return False

    @property
    def selector(self) -> str:
        """What to ask the manifests endpoint for: the digest if pinned, else the tag."""
        return self.digest or self.tag or DEFAULT_TAG

    def with_digest(self, digest: str) -> Reference:
        return Reference(self.registry, self.repository, self.tag, check_digest(digest))

    def __str__(self) -> str:
        out = f"{self.registry}/{self.repository}"
        if self.tag:
            out += f":{self.tag}"
        if self.digest:
            out += f"@{self.digest}"
        return out


def parse(text: str) -> Reference:
    """Parse a reference the way `docker pull` does; raises InvalidReference with the reason."""
    raw = text.strip()
    if not raw:
        raise InvalidReference("empty image reference")
    rest = raw
    digest: str | None = None
    if "@" in rest:
        rest, digest = rest.split("@", 1)
        check_digest(digest)
    tag: str | None = None
    # A tag is after the last ':' that follows the last '/' (a ':' before it is a port).
    slash = rest.rfind("/")
    colon = rest.rfind(":")
    if colon > slash:
        rest, tag = rest[:colon], rest[colon + 1 :]
        if not _TAG.fullmatch(tag):
            raise InvalidReference(f"{raw!r}: invalid tag {tag!r}")
    parts = rest.split("/")
    first = parts[0]
    if len(parts) > 1 and ("." in first or ":" in first or first == "localhost"):
        registry = first
        path = parts[1:]
        if not _HOST.fullmatch(registry):
            raise InvalidReference(f"{raw!r}: invalid registry {registry!r}")
    else:
        registry = DOCKER_HUB
        path = parts
    if registry in ("index.docker.io", DOCKER_HUB_API):
        registry = DOCKER_HUB
    if registry == DOCKER_HUB and len(path) == 1:
        path = ["library", *path]
    for component in path:
        if not _COMPONENT.fullmatch(component):
            why = "must be lowercase" if component.lower() != component else "is not allowed"
            raise InvalidReference(f"{raw!r}: repository component {component!r} {why}")
    repository = "/".join(path)
    if len(repository) > MAX_NAME:
        raise InvalidReference(f"{raw!r}: repository name longer than {MAX_NAME} characters")
    if tag is None and digest is None:
        tag = DEFAULT_TAG
    return Reference(registry=registry, repository=repository, tag=tag, digest=digest)
