"""Guest kernels: Debian's cloud kernel made PVH-bootable, or our own minimal build.

Debian ships ``vmlinuz`` as a bzImage whose payload is an LZ4 (legacy frame) compressed ELF
``vmlinux``; QEMU boots that ELF directly through its PVH entry note, which is ~1 s faster
under emulation than going through the bzImage decompressor.
"""

from __future__ import annotations

import re
import shutil
import struct
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from agentenv.config import Settings
from agentenv.template import debian
from agentenv.template.cache import ArtifactCache, digest_files
from agentenv.template.errors import BuildError
from agentenv.template.hostfacts import tool_version
from agentenv.template.progress import ProgressFn, report

DEBIAN_KERNEL_META = "linux-image-cloud-amd64"
# Load order matters: each module's dependencies come before it.
VIRTIO_MODULES = [
    "virtio_ring",
    "virtio",
    "virtio_mmio",
    "virtio_blk",
    "failover",
    "net_failover",
    "virtio_net",
    "virtio_balloon",
    "virtio-rng",
]
CUSTOM_SOURCE_PACKAGE = "linux-source-6.12"
CUSTOM_CONFIG = Path(__file__).parent / "files" / "microvm.config"
CUSTOM_RECIPE = "2"

LZ4_LEGACY_MAGIC = b"\x02\x21\x4c\x18"
ELF_MAGIC = b"\x7fELF"
XEN_ELFNOTE_PHYS32_ENTRY = 18
PT_NOTE = 4


@dataclass(frozen=True)
class KernelArtifact:
    """A kernel ready to boot: the PVH ``vmlinux`` and, when modular, its virtio modules."""

    vmlinux: Path
    release: str
    modules_dir: Path | None  # <name>.ko files plus an ``order`` file, None if built in


def debian_kernel_inputs() -> dict[str, str]:
    meta_version = debian.require_candidate(DEBIAN_KERNEL_META)
    image = debian.kernel_image_package(DEBIAN_KERNEL_META, meta_version)
    return {
        "package": image,
        "version": meta_version,
        "modules": ",".join(VIRTIO_MODULES),
        "recipe": digest_files(Path(__file__)),
    }


def ensure_debian_kernel(settings: Settings, progress: ProgressFn | None = None) -> KernelArtifact:
    """Debian's cloud kernel as a PVH vmlinux plus the virtio modules, cached by version."""
    cache = ArtifactCache(settings.cache)
    inputs = debian_kernel_inputs()

    def build(out: Path) -> None:
        report(progress, f"downloading {inputs['package']}")
        deb = debian.download(inputs["package"], inputs["version"], settings.cache / "debs")
        report(progress, "extracting the Debian cloud kernel")
        with tempfile.TemporaryDirectory(dir=settings.cache, prefix=".kx-") as scratch:
            root = Path(scratch)
            debian.extract(deb, root)
            vmlinuz = _single(sorted((root / "boot").glob("vmlinuz-*")), "vmlinuz")
            release = vmlinuz.name.removeprefix("vmlinuz-")
            (out / "vmlinux").write_bytes(extract_vmlinux(vmlinuz.read_bytes()))
            shutil.copy2(root / "boot" / f"config-{release}", out / "config")
            (out / "release").write_text(release + "\n")
            mods = out / "modules"
            mods.mkdir()
            _copy_modules(root / "lib" / "modules" / release, mods)

    path, _ = cache.ensure("kernel-debian", inputs, build)
    return KernelArtifact(
        vmlinux=path / "vmlinux",
        release=(path / "release").read_text().strip(),
        modules_dir=path / "modules",
    )


def _copy_modules(tree: Path, dest: Path) -> None:
    index = {}
    for ko in tree.rglob("*.ko*"):
        index[re.sub(r"\.ko(\.(xz|zst|gz))?$", "", ko.name)] = ko
    for name in VIRTIO_MODULES:
        src = index.get(name)
        if src is None:
            continue  # built into this kernel
        target = dest / f"{name}.ko"
        # busybox insmod loads only uncompressed modules.
        if src.name.endswith(".ko"):
            shutil.copy2(src, target)
        else:
            tool = {"xz": "xz", "zst": "zstd", "gz": "gzip"}[src.name.rsplit(".", 1)[1]]
            with open(target, "wb") as fh:
                subprocess.run([tool, "-dc", str(src)], stdout=fh, check=True)
    order = [n for n in VIRTIO_MODULES if (dest / f"{n}.ko").exists()]
    if "virtio_blk" not in order and "virtio_blk" in index:
        raise BuildError("virtio_blk module missing from the kernel package")
    (dest / "order").write_text("".join(f"{n}\n" for n in order))


def extract_vmlinux(vmlinuz: bytes) -> bytes:
    """The ELF vmlinux inside an LZ4-compressed bzImage; checked to carry a PVH entry note."""
    start = vmlinuz.find(LZ4_LEGACY_MAGIC)
    if start < 0:
        raise BuildError("vmlinuz has no LZ4 payload (expected the lz4-legacy magic 02214c18)")
    # lz4 stops with an error at the bzImage trailer after the payload; the output is complete.
    proc = subprocess.run(["lz4", "-dc"], input=vmlinuz[start:], capture_output=True, check=False)
    elf = proc.stdout
    if not elf.startswith(ELF_MAGIC):
        raise BuildError("decompressed kernel payload is not an ELF image")
    if not has_pvh_note(elf):
        raise BuildError("kernel has no PVH entry note; QEMU cannot boot it as vmlinux")
    return elf


def has_pvh_note(elf: bytes) -> bool:
    try:
        return _find_pvh_note(elf)
    except (struct.error, IndexError, OverflowError):  # truncated or corrupt headers
        return False


def _find_pvh_note(elf: bytes) -> bool:
    if elf[:4] != ELF_MAGIC or elf[4] != 2:  # ELFCLASS64
        return False
    phoff = struct.unpack_from("<Q", elf, 0x20)[0]
    phentsize, phnum = struct.unpack_from("<HH", elf, 0x36)
    for i in range(phnum):
        off = phoff + i * phentsize
        p_type = struct.unpack_from("<I", elf, off)[0]
        if p_type != PT_NOTE:
            continue
        p_offset = struct.unpack_from("<Q", elf, off + 8)[0]
        p_filesz = struct.unpack_from("<Q", elf, off + 32)[0]
        pos, end = p_offset, p_offset + p_filesz
        while pos + 12 <= end:
            namesz, descsz, ntype = struct.unpack_from("<III", elf, pos)
            name = elf[pos + 12 : pos + 12 + namesz].rstrip(b"\0")
            if name == b"Xen" and ntype == XEN_ELFNOTE_PHYS32_ENTRY:
                return True
            pos += 12 + _align4(namesz) + _align4(descsz)
    return False


def _align4(n: int) -> int:
    return (n + 3) & ~3


def _single(paths: list[Path], what: str) -> Path:
    if len(paths) != 1:
        raise BuildError(f"expected one {what} in the kernel package, found {len(paths)}")
    return paths[0]


# --- our own minimal kernel (opt-in: `aenv kernel build`) ---------------------------------


def _compiler_version() -> str:
    return tool_version("gcc") or "none"


def custom_kernel_inputs(source_version: str) -> dict[str, str]:
    # A version constant rather than this file's digest: a rebuild costs ~10 minutes, so only
    # a change to the build steps themselves (bump CUSTOM_RECIPE) should trigger one.
    return {
        "package": CUSTOM_SOURCE_PACKAGE,
        "version": source_version,
        "config": digest_files(CUSTOM_CONFIG),
        "compiler": _compiler_version(),
        "recipe": CUSTOM_RECIPE,
    }


def find_custom(settings: Settings) -> KernelArtifact | None:
    """The custom kernel built from the installed kernel source, if it is in the cache."""
    version = debian.installed_version(CUSTOM_SOURCE_PACKAGE)
    if version is None:
        return None
    path = ArtifactCache(settings.cache).lookup("kernel-custom", custom_kernel_inputs(version))
    if path is None:
        return None
    release = (path / "release").read_text().strip()
    return KernelArtifact(vmlinux=path / "vmlinux", release=release, modules_dir=None)
