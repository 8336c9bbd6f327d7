"""The ``docker`` template: Docker Engine and Compose v2 inside a sandbox (issue #11).

Debian trixie, not bookworm like ``base``: bookworm has docker.io 20.10 and only the Python
``docker-compose`` v1, trixie has docker.io 26 with Compose v2 as the CLI plugin, so
``docker compose up`` works as task suites write it. Everything else matches ``base`` (user
``user`` with passwordless sudo, also in group ``docker``; python3, curl, git...).

Kernel: sandboxes boot Debian's cloud kernel, whose container features (overlayfs, bridge,
veth, nf_tables, the xtables matches iptables-nft uses, nat) are modules, and the initramfs
carries only virtio's. This template ships those modules, the ``modules.dep`` closure of
`MODULE_DIRS` + `MODULES`, at ``/lib/modules/<release>`` with ``depmod`` run, so ``modprobe``
and the kernel's own autoloading work in the guest. The build key holds the kernel package
and version: a new kernel rebuilds the template. Cgroup v2 is the guest init's (all
controllers delegated from the root). Our own kernel (`aenv kernel build`) has these
features built in (files/microvm.config) and simply finds no module tree for its release.

dockerd: ``files/docker-start`` is installed as ``/etc/agentenv/start.d/docker``; the guest
init runs it before envd and it returns once the Docker API answers, so a template snapshot
(create = resume) already has dockerd running. Its networks come from 100.88.0.0/16 and
100.89.0.0/16 (``files/docker-daemon.json``), never the private ranges (172.17/16 is
Docker's default) that a sandbox may be allowed to reach.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from agentenv import hostdeps
from agentenv.config import Settings
from agentenv.template import debian
from agentenv.template.cache import ArtifactCache, digest_files
from agentenv.template.catalog import Template
from agentenv.template.commands import run
from agentenv.template.errors import BuildError
from agentenv.template.kernel import debian_kernel_inputs
from agentenv.template.progress import ProgressFn, report
from agentenv.template.rootfs import (
    BASE_PACKAGES,
    DEFAULT_UID,
    DEFAULT_USER,
    configure_tree,
    ensure_rootfs_template,
    image_size_mb,
)

DOCKER_NAME = "docker"
CACHE_KIND = "rootfs-docker"
IMAGE = "docker.qcow2"
SUITE = "trixie"
PACKAGES = [
    *BASE_PACKAGES,
    "kmod",
    "docker.io",
    # trixie splits the client from the engine; docker.io only recommends it.
    "docker-cli",
    # Compose v2 (2.26 in trixie), installed as the `docker compose` CLI plugin.
    "docker-compose",
    "containerd",
    "runc",
    "iptables",
]
# Host packages the build needs beyond `hostdeps.HOST_PACKAGES`: debootstrap checks trixie's
# Release file against this keyring.
HOST_PACKAGES = ["debian-archive-keyring"]
FILES = Path(__file__).parent / "files"
START_HOOK = FILES / "docker-start"
DAEMON_JSON = FILES / "docker-daemon.json"
# Whole directories of the kernel's module tree (every netfilter match and target, so rules a
# user writes load too), then single modules; dependencies are added from modules.dep.
MODULE_DIRS = [
    "kernel/net/netfilter",
    "kernel/net/ipv4/netfilter",
    "kernel/net/ipv6/netfilter",
    "kernel/net/bridge",
    "kernel/fs/overlayfs",
]
MODULES = ["veth", "macvlan", "ipvlan", "vxlan", "dummy", "tun", "8021q"]
MODULE_INDEXES = ["modules.order", "modules.builtin", "modules.builtin.modinfo"]
# Free space the template's filesystem has beyond its files: images and containers land on it
# (a sandbox asks for more with diskSizeMB). Sparse in the qcow2, so it costs no disk.
FREE_MB = 2048


def docker_inputs() -> dict[str, str]:
    kernel = debian_kernel_inputs()
    return {
        "suite": SUITE,
        "variant": "minbase",
        "packages": ",".join(PACKAGES),
        "mirror": debian.apt_mirror(),
        "user": f"{DEFAULT_USER}:{DEFAULT_UID}",
        "kernel": f"{kernel['package']}={kernel['version']}",
        "modules": ",".join(MODULE_DIRS + MODULES),
        "files": digest_files(START_HOOK, DAEMON_JSON),
        # rootfs.py too: configure_tree is shared with `base`.
        "recipe": digest_files(Path(__file__), Path(__file__).with_name("rootfs.py")),
    }


def ensure_docker(settings: Settings, progress: ProgressFn | None = None) -> Template:
    """The ``docker`` template, built (~3 min, network to the Debian mirror) and registered
    if it is not already current; a cache hit only registers it."""
    inputs = docker_inputs()
    return ensure_rootfs_template(
        settings, DOCKER_NAME, inputs, _builder(settings, inputs, progress), CACHE_KIND,
        IMAGE, progress,
    )  # fmt: skip


def ensure_docker_image(settings: Settings, progress: ProgressFn | None = None) -> Path:
    """The template's image in the artifact cache (built on a miss), registered nowhere: what
    the test runner builds ahead while it lints (scripts/test)."""
    inputs = docker_inputs()
    path, _ = ArtifactCache(settings.cache).ensure(
        CACHE_KIND, inputs, _builder(settings, inputs, progress)
    )
    return path / IMAGE


def _builder(
    settings: Settings, inputs: dict[str, str], progress: ProgressFn | None
) -> Callable[[Path], None]:
    def build(out: Path) -> None:
        hostdeps.ensure_host_packages(progress, extra=HOST_PACKAGES)
        build_docker_image(settings, inputs, out, progress)

    return build


def build_docker_image(
    settings: Settings, inputs: dict[str, str], out: Path, progress: ProgressFn | None
) -> None:
    """Write ``out/docker.qcow2`` and ``out/size_mb`` from a fresh debootstrap."""
    package, version = inputs["kernel"].split("=", 1)
    report(progress, f"downloading {package}")
    deb = debian.download(package, version, settings.cache / "debs")
    with tempfile.TemporaryDirectory(dir=settings.cache, prefix=".rootfs-docker-") as scratch:
        kernel_root = Path(scratch) / "kernel"
        debian.extract(deb, kernel_root)
        tree = Path(scratch) / "tree"
        report(progress, f"debootstrap {SUITE} with Docker (minbase, ~2 min)")
        run(
            [
                "debootstrap",
                "--variant=minbase",
                f"--include={','.join(PACKAGES)}",
                SUITE,
                tree,
                inputs["mirror"],
            ],
            env={"DEBIAN_FRONTEND": "noninteractive"},
            timeout=3600,
        )
        report(progress, "configuring the docker rootfs")
        configure_tree(tree)
        run(["chroot", tree, "usermod", "--append", "--groups", "docker", DEFAULT_USER])
        install_files(tree)
        release = install_modules(kernel_root, tree)
        report(progress, f"kernel modules for {release} installed")
        used = int(run(["du", "-s", "--block-size=1M", tree]).split()[0])
        size_mb = max(image_size_mb(tree), (used + FREE_MB + 255) // 256 * 256)
        raw = Path(scratch) / "docker.ext4"
        report(progress, f"making the {size_mb} MB ext4 image")
        run(["mkfs.ext4", "-q", "-F", "-L", "rootfs", "-d", tree, raw, f"{size_mb}M"], timeout=1800)
        shutil.rmtree(tree)
        report(progress, "converting to qcow2")
        run(["qemu-img", "convert", "-O", "qcow2", raw, out / IMAGE], timeout=1800)
        (out / "size_mb").write_text(f"{size_mb}\n")
        (out / "kernel-release").write_text(release + "\n")


def install_files(tree: Path) -> None:
    hooks = tree / "etc" / "agentenv" / "start.d"
    hooks.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(START_HOOK, hooks / "docker")
    os.chmod(hooks / "docker", 0o755)
    (tree / "etc" / "docker").mkdir(exist_ok=True)
    shutil.copyfile(DAEMON_JSON, tree / "etc" / "docker" / "daemon.json")


def install_modules(kernel_root: Path, tree: Path) -> str:
    """Copy the container modules of the extracted kernel package into the rootfs; return
    the kernel release."""
    releases = sorted((kernel_root / "lib" / "modules").iterdir())
    if len(releases) != 1:
        raise BuildError(f"expected one module tree in the kernel package, found {len(releases)}")
    src = releases[0]
    release = src.name
    # The package ships no modules.dep (its postinst makes it); make one to resolve with.
    run(["depmod", "-b", kernel_root, release])
    wanted = module_closure(src)
    dest = tree / "usr" / "lib" / "modules" / release
    for rel in sorted(wanted):
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src / rel, dest / rel)
    for name in MODULE_INDEXES:
        if (src / name).exists():
            shutil.copy2(src / name, dest / name)
    # The rootfs is usr-merged (/lib -> usr/lib), so -b finds the tree under lib/modules.
    run(["depmod", "-b", tree, release])
    if not (dest / "modules.dep").exists():
        raise BuildError(f"depmod made no modules.dep for {release} in the docker rootfs")
    return release


def module_closure(tree: Path) -> set[str]:
    """Paths (relative to ``tree``) of `MODULE_DIRS`, `MODULES` and everything they need."""
    deps: dict[str, list[str]] = {}
    for line in (tree / "modules.dep").read_text().splitlines():
        if ":" in line:
            mod, _, rest = line.partition(":")
            deps[mod] = rest.split()
    by_name = {_module_name(p): p for p in deps}
    seeds = [p for p in deps if any(p.startswith(d + "/") for d in MODULE_DIRS)]
    for name in MODULES:
        if name in by_name:
            seeds.append(by_name[name])
        elif not _builtin(tree, name):
            raise BuildError(f"kernel module {name} is neither in the package nor built in")
    for d in MODULE_DIRS:
        if not any(p.startswith(d + "/") for p in seeds):
            raise BuildError(f"the kernel package has no modules under {d}")
    found: set[str] = set()
    todo = list(seeds)
    while todo:
        mod = todo.pop()
        if mod not in found:
            found.add(mod)
            todo.extend(deps.get(mod, []))
    return found


def _module_name(path: str) -> str:
    return re.sub(r"\.ko(\.(xz|zst|gz))?$", "", path.rsplit("/", 1)[-1]).replace("-", "_")


def _builtin(tree: Path, name: str) -> bool:
    builtin = tree / "modules.builtin"
    if not builtin.exists():
        return False
    return any(_module_name(line.strip()) == name for line in builtin.read_text().splitlines())
