"""Single image files: inspect, create an upper, change a backing link.

Inspecting a qcow2 and creating an upper are in-process (`agentenv.storage.qcow2`): they sit on
the create path, where a spawned qemu-img cost a fork+exec per layer. Converting and rebasing
(layer import, snapshot sealing) still run qemu-img."""

from __future__ import annotations

import asyncio
import json
import subprocess
from dataclasses import dataclass
from pathlib import Path

from agentenv.storage import qcow2
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
    try:
        if qcow2.is_qcow2(path):
            # The header is read without a lock, so a running VM's upper is readable too.
            header = qcow2.read_header(path)
            return ImageInfo(
                path=path,
                format="qcow2",
                virtual_size=header.virtual_size,
                backing_file=_resolve(path, header.backing_file),
            )
    except (OSError, UnicodeDecodeError, qcow2.Qcow2Error) as exc:
        raise ImageError(f"cannot read the qcow2 header of {path}: {exc}") from exc
    return _info_qemu_img(path)


def _resolve(path: Path, backing: str | None) -> Path | None:
    if not backing:
        return None
    backing_path = Path(backing)
    if not backing_path.is_absolute():
        backing_path = (path.parent / backing_path).resolve()
    return backing_path


def _info_qemu_img(path: Path) -> ImageInfo:
    """Any other format (raw imports): ask qemu-img. Not on the create path."""
    # -U: a running VM holds a write lock on its upper; reading metadata must still work.
    data = json.loads(_run(["info", "-U", "--output=json", str(path)]))
    backing = data.get("full-backing-filename") or data.get("backing-filename")
    return ImageInfo(
        path=path,
        format=str(data["format"]),
        virtual_size=int(data["virtual-size"]),
        backing_file=_resolve(path, backing),
    )


def convert_to_qcow2(src: Path, dest: Path) -> None:
    _run(["convert", "-O", "qcow2", str(src), str(dest)])


def rebase_unsafe(path: Path, backing: Path) -> None:
    """Point `path` at `backing` without copying data (both must hold the same content)."""
    _run(["rebase", "-u", "-F", "qcow2", "-b", str(backing), str(path)])


def _write_overlay(dest: Path, size: int, backing: Path, backing_format: str) -> None:
    try:
        qcow2.write_overlay(dest, size, str(backing.resolve()), backing_format)
    except FileExistsError as exc:
        raise ImageError(f"{dest} already exists") from exc
    except (OSError, qcow2.Qcow2Error) as exc:
        raise ImageError(f"cannot create {dest}: {exc}") from exc


def create_upper_sync(backing: Path, dest: Path, size_mb: int | None = None) -> None:
    """Create a writable qcow2 over `backing`; `size_mb` may only grow the disk."""
    base = info(backing)
    size = base.virtual_size
    if size_mb is not None:
        if size_mb <= 0:
            raise DiskTooSmall(f"disk size must be positive, got {size_mb} MB")
        size = size_mb * MIB
        if size < base.virtual_size:
            raise DiskTooSmall(
                f"disk of {size_mb} MB is smaller than the template's "
                f"{-(-base.virtual_size // MIB)} MB"
            )
    _write_overlay(dest, size, backing, base.format)


async def create_upper(backing: Path, dest: Path, size_mb: int | None = None) -> None:
    """Async wrapper: a header and a few small writes, kept off the event loop all the same."""
    await asyncio.to_thread(create_upper_sync, backing, dest, size_mb)


def create_overlay_sync(backing: Path, dest: Path) -> None:
    """A new upper for sealing: same size as its backing, created before QEMU opens it."""
    base = info(backing)
    _write_overlay(dest, base.virtual_size, backing, base.format)
