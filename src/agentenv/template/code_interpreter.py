"""The ``code-interpreter-v1`` template (alias ``code-interpreter``): `base` plus the
code-interpreter server (`agentenv.guest.interpreter`) on port 49999, the server the E2B
code-interpreter SDKs talk to.

Built offline for the guest, from the cached `base` image, without debootstrap:
1. the host downloads the wheels of the server's ``requirements.txt`` for the guest's Python
   (CPython 3.11, glibc 2.36, x86_64), cached by that file (`ensure_wheels`);
2. `base`'s ext4 is converted to raw, grown, loop-mounted, and given the installed wheels
   (``/usr/local/lib/python3.11/dist-packages``, which Debian's python3 reads), the server's
   package (``/opt/agentenv/interpreter``) and a start hook;
3. converted back to one qcow2 layer.

The start hook (``files/code-interpreter-start``, in ``/etc/agentenv/start.d``) starts the
server and returns once its ``/health`` is 200, i.e. once the default python kernel answers,
so the template snapshot (create = resume) already has the kernel running.

The server's package lives outside ``dist-packages`` and runs from its own directory: user
code in the kernels never imports it by accident (``interpreter`` is a common module name).
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from agentenv.config import Settings
from agentenv.contract.runtime import ON_DEMAND_TEMPLATES
from agentenv.template.cache import ArtifactCache, digest_files, input_key
from agentenv.template.catalog import Template
from agentenv.template.commands import run
from agentenv.template.errors import BuildError
from agentenv.template.progress import ProgressFn, report
from agentenv.template.rootfs import base_inputs, ensure_base, ensure_rootfs_template

NAME = ON_DEMAND_TEMPLATES["code-interpreter"]
CACHE_KIND = "rootfs-code-interpreter"
WHEELS_KIND = "wheels-code-interpreter"
IMAGE = "code-interpreter.qcow2"
PACKAGE = Path(__file__).resolve().parents[1] / "guest" / "interpreter"
REQUIREMENTS = PACKAGE / "requirements.txt"
START_HOOK = Path(__file__).parent / "files" / "code-interpreter-start"
GUEST_SITE = Path("usr/local/lib/python3.11/dist-packages")
GUEST_PACKAGE = Path("opt/agentenv/interpreter")
# The guest's interpreter and C library: Debian bookworm's CPython 3.11 on glibc 2.36. Wheels
# for older manylinux levels run there too; pip is given each level explicitly.
GUEST_WHEEL_TAGS = [
    "--only-binary=:all:",
    "--python-version",
    "3.11",
    "--implementation",
    "cp",
    *("--abi", "cp311", "--abi", "abi3", "--abi", "none"),
    *("--platform", "manylinux_2_36_x86_64", "--platform", "manylinux_2_28_x86_64"),
    *("--platform", "manylinux_2_17_x86_64", "--platform", "manylinux2014_x86_64"),
    *("--platform", "any"),
]
# Room for what users write and install beyond the files (sparse in the qcow2).
FREE_MB = 1024


def resolve(name: str) -> str:
    """The catalog name a create's template name stands for."""
    return ON_DEMAND_TEMPLATES.get(name, name)


def wheels_inputs() -> dict[str, str]:
    return {"requirements": digest_files(REQUIREMENTS), "tags": " ".join(GUEST_WHEEL_TAGS)}


def code_interpreter_inputs() -> dict[str, str]:
    return {
        "base": input_key(base_inputs()),
        "wheels": input_key(wheels_inputs()),
        # The package's sources only: tests that import it leave __pycache__ beside them.
        "package": digest_files(*sorted(PACKAGE.glob("*.py")), REQUIREMENTS),
        "hook": digest_files(START_HOOK),
        "recipe": digest_files(Path(__file__)),
    }


def ensure_code_interpreter(settings: Settings, progress: ProgressFn | None = None) -> Template:
    """The template, built (~1 min from a warm `base`: wheel download, install, image) and
    registered if it is not already current; a cache hit only registers it."""
    ensure_base(settings, progress)  # its image is what this one starts from
    inputs = code_interpreter_inputs()
    return ensure_rootfs_template(
        settings, NAME, inputs, _builder(settings, progress), CACHE_KIND, IMAGE, progress
    )


def ensure_code_interpreter_image(settings: Settings, progress: ProgressFn | None = None) -> Path:
    """The template's image in the artifact cache (built on a miss), registered nowhere: what
    the test runner builds ahead while it lints. Needs `base`'s image in the cache."""
    path, _ = ArtifactCache(settings.cache).ensure(
        CACHE_KIND, code_interpreter_inputs(), _builder(settings, progress)
    )
    return path / IMAGE


def ensure_wheels(settings: Settings, progress: ProgressFn | None = None) -> Path:
    """A directory of the wheels `REQUIREMENTS` resolves to for the guest's Python."""

    def build(out: Path) -> None:
        report(progress, "downloading the code interpreter's wheels for the guest's Python")
        _pip(["download", "--quiet", "--dest", out, *GUEST_WHEEL_TAGS, "-r", REQUIREMENTS])

    path, _ = ArtifactCache(settings.cache).ensure(WHEELS_KIND, wheels_inputs(), build)
    return path


def _builder(settings: Settings, progress: ProgressFn | None) -> Callable[[Path], None]:
    def build(out: Path) -> None:
        build_image(settings, out, progress)

    return build


def build_image(settings: Settings, out: Path, progress: ProgressFn | None) -> None:
    """Write ``out/<IMAGE>`` and ``out/size_mb``: `base`'s filesystem plus the server."""
    base = ArtifactCache(settings.cache).lookup("rootfs-base", base_inputs())
    if base is None:
        raise BuildError("the base image is not in the cache (run `aenv setup`)")
    wheels = ensure_wheels(settings, progress)
    with tempfile.TemporaryDirectory(dir=settings.cache, prefix=".rootfs-ci-") as scratch:
        work = Path(scratch)
        site = work / "site"
        report(progress, "installing the code interpreter's wheels")
        _pip(
            [
                "install",
                "--quiet",
                "--no-index",
                "--no-warn-conflicts",
                "--find-links",
                wheels,
                "--target",
                site,
                *GUEST_WHEEL_TAGS,
                "-r",
                REQUIREMENTS,
            ]
        )
        # Console scripts carry the host interpreter's path in their shebang.
        shutil.rmtree(site / "bin", ignore_errors=True)
        site_mb = _used_mb(site)
        base_mb = int((base / "size_mb").read_text())
        size_mb = (base_mb + site_mb * 5 // 4 + FREE_MB + 255) // 256 * 256
        raw = work / "rootfs.ext4"
        report(progress, f"making the {size_mb} MB image from base's")
        run(["qemu-img", "convert", "-O", "raw", base / "base.qcow2", raw], timeout=600)
        os.truncate(raw, size_mb << 20)
        run(["e2fsck", "-f", "-p", raw], timeout=600)
        run(["resize2fs", "-f", raw, f"{size_mb}M"], timeout=600)
        add = work / "add"
        _stage(site, add)
        mnt = work / "mnt"
        mnt.mkdir()
        # Mounted in a mount namespace of its own: if this process dies mid-copy, the mount
        # (and its auto-clearing loop device) goes with the namespace, never left behind.
        run(
            [
                "unshare", "--mount", "--propagation", "private", "--", "sh", "-c",
                'mount -o loop,noatime "$1" "$2" && cp -a "$3"/. "$2"/ && umount "$2"',
                "sh", raw, mnt, add,
            ],
            timeout=600,
        )  # fmt: skip
        report(progress, "converting to qcow2")
        run(["qemu-img", "convert", "-O", "qcow2", raw, out / IMAGE], timeout=1800)
        (out / "size_mb").write_text(f"{size_mb}\n")


def _stage(site: Path, root: Path) -> None:
    """The files to add to `base`'s filesystem, laid out under `root` as they land: the
    wheels, the server's package and its start hook (root-owned: the build runs as root)."""
    shutil.copytree(site, root / GUEST_SITE, symlinks=True)
    package = root / GUEST_PACKAGE
    package.mkdir(parents=True)
    for src in [*sorted(PACKAGE.glob("*.py")), REQUIREMENTS]:
        shutil.copyfile(src, package / src.name)
    hooks = root / "etc" / "agentenv" / "start.d"
    hooks.mkdir(parents=True)
    shutil.copyfile(START_HOOK, hooks / "code-interpreter")
    os.chmod(hooks / "code-interpreter", 0o755)
    # cp -a carries these modes onto the image's directories that exist already (/usr, /etc).
    for path in [root, *(p for p in root.rglob("*") if p.is_dir())]:
        os.chmod(path, 0o755)


def _pip(args: list[str | Path]) -> None:
    # The host's own pip (the project's venv): its index settings, its download cache.
    run([sys.executable, "-m", "pip", "--disable-pip-version-check", *args], timeout=1800)


def _used_mb(tree: Path) -> int:
    return int(run(["du", "-s", "--block-size=1M", tree]).split()[0])
