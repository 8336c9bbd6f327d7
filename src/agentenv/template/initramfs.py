"""The initramfs for modular kernels: static busybox, the virtio modules and a small /init.

It is an uncompressed newc cpio: a compressed one costs ~1 s of decompression under TCG.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path

from agentenv.config import Settings
from agentenv.template import debian
from agentenv.template.cache import ArtifactCache, digest_files
from agentenv.template.errors import BuildError
from agentenv.template.kernel import KernelArtifact
from agentenv.template.progress import ProgressFn, report

GUEST_FILES = Path(__file__).resolve().parent.parent / "guest" / "files"
INIT_SCRIPT = GUEST_FILES / "initramfs-init"
BUSYBOX = Path("/bin/busybox")


def busybox_version() -> str:
    version = debian.installed_version("busybox-static")
    if version is None:
        raise BuildError("busybox-static is not installed (run `aenv setup`)")
    return version


def ensure_initramfs(
    settings: Settings, kernel: KernelArtifact, progress: ProgressFn | None = None
) -> Path:
    if kernel.modules_dir is None:
        raise BuildError("this kernel has no modules; it boots without an initramfs")
    modules_dir = kernel.modules_dir
    inputs = {
        "kernel": kernel.vmlinux.parent.name,  # the kernel artifact's own input hash
        "busybox": busybox_version(),
        "init": digest_files(INIT_SCRIPT),
        "recipe": digest_files(Path(__file__)),
    }

    def build(out: Path) -> None:
        report(progress, "building the initramfs")
        with tempfile.TemporaryDirectory(dir=settings.cache, prefix=".initrd-") as scratch:
            root = Path(scratch)
            for d in ("bin", "dev", "proc", "sys", "tools", "modules"):
                (root / d).mkdir()
            shutil.copy2(BUSYBOX, root / "bin" / "busybox")
            shutil.copy2(INIT_SCRIPT, root / "init")
            os.chmod(root / "init", 0o755)
            # The kernel opens /dev/console for init before anything is mounted.
            os.mknod(root / "dev" / "console", 0o600 | stat.S_IFCHR, os.makedev(5, 1))
            for ko in modules_dir.iterdir():
                shutil.copy2(ko, root / "modules" / ko.name)
            write_cpio(root, out / "initramfs.cpio")

    path, _ = ArtifactCache(settings.cache).ensure("initramfs", inputs, build)
    return path / "initramfs.cpio"


def write_cpio(root: Path, dest: Path) -> None:
    """An uncompressed newc archive of ``root``, every entry owned by root."""
    names = sorted(str(p.relative_to(root)) for p in root.rglob("*"))
    listing = ("\n".join(names) + "\n").encode()
    with open(dest, "wb") as fh:
        proc = subprocess.run(
            ["cpio", "--quiet", "-o", "-H", "newc", "-R", "0:0"],
            cwd=root,
            input=listing,
            stdout=fh,
            stderr=subprocess.PIPE,
            check=False,
        )
    if proc.returncode != 0:
        raise BuildError(f"cpio failed: {proc.stderr.decode(errors='replace').strip()}")
