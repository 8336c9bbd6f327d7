"""The default template ``base``: a Debian bookworm rootfs as one read-only disk layer.

debootstrap (minbase plus the tools agents expect) → a ``user`` account with passwordless
sudo, like E2B's images → ext4 (``mkfs.ext4 -d``, no mount) → qcow2 → the layer store, and the
catalog entry ``base`` pointing at it. The qcow2 stays in the build cache keyed by its inputs,
so a fresh data dir re-registers it without running debootstrap again.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from agentenv.config import Settings
from agentenv.storage.errors import StorageError
from agentenv.storage.layers import LayerStore
from agentenv.template import debian
from agentenv.template.cache import ArtifactCache, digest_files, input_key
from agentenv.template.catalog import Template, TemplateCatalog
from agentenv.template.commands import run
from agentenv.template.errors import BuildError, TemplateNotFound
from agentenv.template.progress import ProgressFn, report

BASE_NAME = "base"
SUITE = "bookworm"
BASE_PACKAGES = [
    "bash",
    "coreutils",
    "python3",
    # `python` is python3, as in E2B's base image (a symlink in /usr/bin).
    "python-is-python3",
    "curl",
    "git",
    "procps",
    "iproute2",
    "iputils-ping",
    "sudo",
    "ca-certificates",
    "netbase",
    "less",
    "e2fsprogs",
]
DEFAULT_USER = "user"
DEFAULT_UID = 1000
MIN_SIZE_MB = 1024
HOLDER = "template:"


def base_inputs() -> dict[str, str]:
    return {
        "suite": SUITE,
        "variant": "minbase",
        "packages": ",".join(BASE_PACKAGES),
        "mirror": debian.apt_mirror(),
        "user": f"{DEFAULT_USER}:{DEFAULT_UID}",
        "recipe": digest_files(Path(__file__)),
    }


def ensure_base(settings: Settings, progress: ProgressFn | None = None) -> Template:
    """The ``base`` template, built and registered if it is not already current."""

    def build(out: Path) -> None:
        build_rootfs_image(settings, out, progress)

    return ensure_rootfs_template(
        settings, BASE_NAME, base_inputs(), build, "rootfs-base", "base.qcow2", progress
    )


def ensure_rootfs_template(
    settings: Settings,
    name: str,
    inputs: dict[str, str],
    build: Callable[[Path], None],
    cache_kind: str,
    image: str,
    progress: ProgressFn | None = None,
) -> Template:
    """A catalog template made of one rootfs layer: `build(out)` writes `out/<image>` (a
    qcow2) and `out/size_mb`, cached under `cache_kind` by `inputs`. A template whose build
    key and layer are current is returned as it is; a cache hit only registers the layer."""
    key = input_key(inputs)
    catalog = TemplateCatalog(settings)
    store = LayerStore(settings.layers_dir)
    try:
        current: Template | None = catalog.get(name)
    except TemplateNotFound:
        current = None
    if current is not None and current.build_key == key and _layers_present(store, current):
        return current
    path, _ = ArtifactCache(settings.cache).ensure(cache_kind, inputs, build)
    report(progress, f"adding the {name} layer to the layer store")
    digest = store.add(path / image)
    store.ref(digest, HOLDER + name)
    size_mb = int((path / "size_mb").read_text())
    template = Template(name=name, layers=[digest], size_mb=size_mb, build_key=key)
    catalog.put(template)
    if current is not None:
        for old in current.layers:
            if old != digest:
                store.unref(old, HOLDER + name)
    return template


def _layers_present(store: LayerStore, template: Template) -> bool:
    try:
        for digest in template.layers:
            store.path(digest)
    except StorageError:
        return False
    return True


def build_rootfs_image(settings: Settings, out: Path, progress: ProgressFn | None) -> None:
    """Write ``out/base.qcow2`` and ``out/size_mb`` (the ext4 size) from a fresh debootstrap."""
    mirror = debian.apt_mirror()
    with tempfile.TemporaryDirectory(dir=settings.cache, prefix=".rootfs-") as scratch:
        tree = Path(scratch) / "tree"
        report(progress, f"debootstrap {SUITE} (minbase, ~2 min)")
        run(
            [
                "debootstrap",
                "--variant=minbase",
                f"--include={','.join(BASE_PACKAGES)}",
                SUITE,
                tree,
                mirror,
            ],
            env={"DEBIAN_FRONTEND": "noninteractive"},
            timeout=3600,
        )
        report(progress, "configuring the base rootfs")
        configure_tree(tree)
        size_mb = image_size_mb(tree)
        raw = Path(scratch) / "base.ext4"
        report(progress, f"making the {size_mb} MB ext4 image")
        run(["mkfs.ext4", "-q", "-F", "-L", "rootfs", "-d", tree, raw, f"{size_mb}M"], timeout=1800)
        shutil.rmtree(tree)
        report(progress, "converting to qcow2")
        run(["qemu-img", "convert", "-O", "qcow2", raw, out / "base.qcow2"], timeout=1800)
        (out / "size_mb").write_text(f"{size_mb}\n")


def configure_tree(tree: Path) -> None:
    """Default user, sudo, hostname and cleanup, done with the rootfs's own tools."""
    if not (tree / "usr" / "sbin" / "useradd").exists():
        raise BuildError("debootstrap produced no useradd; the rootfs is incomplete")
    run(
        [
            "chroot",
            tree,
            "useradd",
            "--create-home",
            "--uid",
            str(DEFAULT_UID),
            "--shell",
            "/bin/bash",
            "--user-group",
            DEFAULT_USER,
        ]
    )
    sudoers = tree / "etc" / "sudoers.d" / DEFAULT_USER
    sudoers.write_text(f"{DEFAULT_USER} ALL=(ALL:ALL) NOPASSWD: ALL\n")
    os.chmod(sudoers, 0o440)
    # Every `commands.run` is a `bash -l -c` (as upstream's), whose /etc/profile asks
    # `$(id -u)`: a process spawn per command (~40 ms of a guest under TCG, a quarter of a
    # `commands.run("true")`). bash knows its uid ($EUID); other shells still ask `id`.
    profile = tree / "etc" / "profile"
    if profile.exists():
        profile.write_text(profile.read_text().replace('"$(id -u)"', '"${EUID:-$(id -u)}"'))
    (tree / "etc" / "hostname").write_text("sandbox\n")
    (tree / "etc" / "hosts").write_text(
        "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n"
    )
    # debootstrap copies the host's resolver config; the guest init writes its own.
    (tree / "etc" / "resolv.conf").unlink(missing_ok=True)
    (tree / ".agentenv").mkdir(exist_ok=True)
    run(["chroot", tree, "apt-get", "clean"])
    # Files only: apt and the loggers expect their directories to exist.
    for junk in ("var/lib/apt/lists", "var/cache/apt", "var/log"):
        for entry in (tree / junk).rglob("*"):
            if (entry.is_file() or entry.is_symlink()) and entry.name != "lock":
                entry.unlink()
    (tree / "etc" / "machine-id").write_text("")


def image_size_mb(tree: Path) -> int:
    used = int(run(["du", "-s", "--block-size=1M", tree]).split()[0])
    # Room for the journal, inode tables and a little growth; the sandbox upper grows further.
    size = max(MIN_SIZE_MB, used * 3 // 2)
    return (size + 255) // 256 * 256
