"""Debian package queries and downloads used to source guest artifacts from the archive."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from agentenv.template.commands import run
from agentenv.template.errors import BuildError
from agentenv.template.hostfacts import APT_STATE, DPKG_STATE, remembered


def installed_versions(packages: list[str]) -> dict[str, str | None]:
    """Installed version of each package, None where it is not (fully) installed."""
    argv = ["dpkg-query", "-W", "-f=${Package}\t${db:Status-Abbrev}\t${Version}\n", *packages]

    def query() -> str:
        # Exit 1 names packages dpkg does not know: the others are still listed.
        return subprocess.run(argv, capture_output=True, text=True, check=False).stdout

    found: dict[str, str | None] = dict.fromkeys(packages)
    for line in remembered(argv, DPKG_STATE, query).splitlines():
        name, status, version = ([*line.split("\t"), "", ""])[:3]
        name = name.split(":")[0]
        if name in found and status.startswith("ii"):
            found[name] = version
    return found


def installed_version(package: str) -> str | None:
    return installed_versions([package])[package]


def candidate_version(package: str) -> str | None:
    argv = ["apt-cache", "policy", package]
    out = remembered(argv, APT_STATE, lambda: run(argv))
    m = re.search(r"^\s*Candidate:\s*(\S+)", out, re.M)
    if m is None or m.group(1) == "(none)":
        return None
    return m.group(1)


def require_candidate(package: str) -> str:
    version = candidate_version(package)
    if version is None:
        raise BuildError(f"package {package} is not available from apt (run `apt-get update`)")
    return version


def kernel_image_package(meta: str, version: str) -> str:
    """The versioned linux-image-* package a metapackage version depends on."""
    argv = ["apt-cache", "show", f"{meta}={version}"]
    out = remembered(argv, APT_STATE, lambda: run(argv))
    m = re.search(r"^Depends:.*?\b(linux-image-[0-9][^\s,(]*)", out, re.M)
    if m is None:
        raise BuildError(f"{meta} {version} does not depend on a linux-image package")
    return m.group(1)


def download(package: str, version: str, dest: Path) -> Path:
    """The .deb for package=version in ``dest``, downloaded with apt-get if not there yet."""
    dest.mkdir(parents=True, exist_ok=True)
    # apt escapes the epoch colon in file names.
    pattern = f"{package}_{version.replace(':', '%3a')}_*.deb"
    existing = sorted(dest.glob(pattern))
    if existing:
        return existing[0]
    tmp = dest / ".partial"
    tmp.mkdir(exist_ok=True)
    for old in tmp.glob("*.deb"):
        old.unlink()
    run(
        ["apt-get", "download", "-q", "-o", "APT::Sandbox::User=root", f"{package}={version}"],
        cwd=tmp,
        timeout=1800,
    )
    got = sorted(tmp.glob(pattern))
    if not got:
        raise BuildError(f"apt-get download {package}={version} produced no .deb")
    final = dest / got[0].name
    got[0].rename(final)
    return final


def extract(deb: Path, dest: Path) -> None:
    run(["dpkg-deb", "-x", deb, dest])


def apt_mirror() -> str:
    """The Debian archive URI the host's apt sources use (deb.debian.org as a fallback)."""
    candidates: list[Path] = [Path("/etc/apt/sources.list")]
    candidates += sorted(Path("/etc/apt/sources.list.d").glob("*"))
    for path in candidates:
        try:
            text = path.read_text()
        except OSError:
            continue
        for m in re.finditer(r"(?:^deb\s+(?:\[[^]]*\]\s+)?|^URIs:\s*)(\S+)", text, re.M):
            uri = m.group(1).rstrip("/")
            if uri.endswith("/debian"):
                return uri
    return "http://deb.debian.org/debian"
