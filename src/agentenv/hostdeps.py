"""Host packages agentenv needs, installed from Debian's archive when missing."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from agentenv.template.commands import run
from agentenv.template.debian import candidate_version, installed_versions
from agentenv.template.errors import BuildError
from agentenv.template.progress import ProgressFn, report

HOST_PACKAGES = [
    "qemu-system-x86",
    "qemu-utils",
    "iproute2",
    "nftables",
    "e2fsprogs",
    "debootstrap",
    "busybox-static",
    "lz4",
    "cpio",
    "zstd",
    "xz-utils",
    "kmod",
    "ca-certificates",
    # The guest's Python runtime (tools layer) is copied from these.
    "python3.11-minimal",
    "libpython3.11-stdlib",
    # The RAM preload library QEMU gets for clones of a snapshot (vmm/files/ramshim.c).
    "gcc",
    "libc6-dev",
]

KERNEL_BUILD_PACKAGES = [
    "linux-source-6.12",
    "bison",
    "flex",
    "cpio",
    "dwarves",
    "kmod",
    "libelf-dev",
    "m4",
    "rsync",
    "bc",
    "libssl-dev",
    "gcc",
    "make",
]

# What the test suite runs besides Python, as command -> the Debian package that provides it:
# node and npm (the E2B JS SDK leg, tests/e2e/test_js_sdk.py), musl-gcc (the musl image of
# tests/e2e/test_image_templates_sdk.py), etcd (tests/cluster). Checked by command, not by
# package: a Node.js from another source (one whose `nodejs` package bundles npm and conflicts
# with Debian's `npm`) must not be replaced.
TEST_COMMANDS = {
    "node": "nodejs",
    "npm": "npm",
    "musl-gcc": "musl-tools",
    "etcd": "etcd-server",
}
# What the benchmarks compare against (bench/templates.py: `skopeo copy` as the pull baseline).
BENCH_COMMANDS = {"skopeo": "skopeo"}

APT_ENV = {"DEBIAN_FRONTEND": "noninteractive"}


def missing_packages(packages: list[str]) -> list[str]:
    return [name for name, version in installed_versions(packages).items() if version is None]


def ensure_host_packages(
    progress: ProgressFn | None = None, extra: list[str] | None = None
) -> list[str]:
    """Install whichever of the host packages are missing; return the ones installed."""
    wanted = list(dict.fromkeys(HOST_PACKAGES + (extra or [])))
    report(progress, "checking host packages")
    missing = missing_packages(wanted)
    if not missing:
        return []
    _apt_install(missing, progress)
    return missing


def ensure_test_commands(progress: ProgressFn | None = None) -> list[str]:
    """Install the package of each `TEST_COMMANDS` command not on PATH; return those installed."""
    report(progress, "checking test tools")
    return _ensure_commands(TEST_COMMANDS, progress)


def ensure_bench_commands(progress: ProgressFn | None = None) -> list[str]:
    """The same for `BENCH_COMMANDS` (the benchmarks' baselines)."""
    report(progress, "checking benchmark tools")
    return _ensure_commands(BENCH_COMMANDS, progress)


def _ensure_commands(commands: dict[str, str], progress: ProgressFn | None) -> list[str]:
    missing = list(dict.fromkeys(p for c, p in commands.items() if shutil.which(c) is None))
    if missing:
        _apt_install(missing, progress)
    return missing


def _apt_install(missing: list[str], progress: ProgressFn | None) -> None:
    if os.geteuid() != 0:
        raise BuildError(f"missing host packages ({' '.join(missing)}); run `aenv setup` as root")
    # Refresh package lists only when one of them is not known to apt yet.
    if _lists_empty() or any(candidate_version(p) is None for p in missing):
        report(progress, "apt-get update")
        run(["apt-get", "update", "-q"], env=APT_ENV, timeout=1800)
    report(progress, f"installing {' '.join(missing)}")
    run(
        ["apt-get", "install", "-y", "-q", "--no-install-recommends", *missing],
        env=APT_ENV,
        timeout=3600,
    )
    still = missing_packages(missing)
    if still:
        raise BuildError(f"apt-get did not install: {' '.join(still)}")


def _lists_empty() -> bool:
    lists = Path("/var/lib/apt/lists")
    return not any(lists.glob("*_Packages*"))
