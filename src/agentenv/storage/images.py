"""qemu-img operations on single image files: inspect, create an upper, change a backing link."""

from __future__ import annotations

import asyncio
import json
import subprocess
from dataclasses import dataclass
from pathlib import Path

from agentenv.storage.errors import DiskTooSmall, ImageError

MIB = 1024 * 1024
QEMU_IMG = "qemu-img"


@dataclass(frozen=True)
class ImageInfo:
    path: Path
    format: str
    virtual_size: int
    backing_file: Path | None


def _run(args: list[str]) -> str:
    try:
        proc = subprocess.run(
            [QEMU_IMG, *args], capture_output=True, text=True, check=False, timeout=600
        )
    except FileNotFoundError as exc:
        raise ImageError(f"{QEMU_IMG} is not installed (apt-get install qemu-utils)") from exc
    if proc.returncode != 0:
        msg = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else "no output"
        raise ImageError(f"qemu-img {args[0]} failed: {msg}")
    return proc.stdout


def info(path: Path) -> ImageInfo:
    """Read an image's format, virtual size and direct backing file (not the whole chain)."""
    if not path.is_file():
        raise ImageError(f"image {path} does not exist")
    # -U: a running VM holds a write lock on its upper; reading metadata must still work.
    data = json.loads(_run(["info", "-U", "--output=json", str(path)]))
    backing = data.get("full-backing-filename") or data.get("backing-filename")
    backing_path: Path | None = None
    if backing:
        backing_path = Path(backing)
        if not backing_path.is_absolute():
            backing_path = (path.parent / backing_path).resolve()
    return ImageInfo(
        path=path,
        format=str(data["format"]),
        virtual_size=int(data["virtual-size"]),
        backing_file=backing_path,
    )


def convert_to_qcow2(src: Path, dest: Path) -> None:
    _run(["convert", "-O", "qcow2", str(src), str(dest)])


def rebase_unsafe(path: Path, backing: Path) -> None:
    """Point `path` at `backing` without copying data (both must hold the same content)."""
    _run(["rebase", "-u", "-F", "qcow2", "-b", str(backing), str(path)])


def create_upper_sync(backing: Path, dest: Path, size_mb: int | None = None) -> None:
    """Create a writable qcow2 over `backing`; `size_mb` may only grow the disk."""
    base = info(backing)
    args = ["create", "-q", "-f", "qcow2", "-F", base.format, "-b", str(backing.resolve())]
    args += ["-o", "cluster_size=65536"]
    args.append(str(dest))
    if size_mb is not None:
        if size_mb <= 0:
            raise DiskTooSmall(f"disk size must be positive, got {size_mb} MB")
        want = size_mb * MIB
        if want < base.virtual_size:
            raise DiskTooSmall(
                f"disk of {size_mb} MB is smaller than the template's "
                f"{-(-base.virtual_size // MIB)} MB"
            )
        args.append(str(want))
    if dest.exists():
        raise ImageError(f"{dest} already exists")
    try:
        _run(args)
    except BaseException:
        dest.unlink(missing_ok=True)
        raise


async def create_upper(backing: Path, dest: Path, size_mb: int | None = None) -> None:
    """Async wrapper: qemu-img takes a few ms, but it must not block the event loop."""
    await asyncio.to_thread(create_upper_sync, backing, dest, size_mb)


def create_overlay_sync(backing: Path, dest: Path) -> None:
    """A new upper for sealing: same size as its backing, created before QEMU opens it."""
    if dest.exists():
        raise ImageError(f"{dest} already exists")
    base = info(backing)
    _run(
        [
            "create",
            "-q",
            "-f",
            "qcow2",
            "-F",
            base.format,
            "-b",
            str(backing.resolve()),
            "-u",
            str(dest),
            str(base.virtual_size),
        ]
    )
