"""A block layer build whose scratch filesystem fills up fails, naming the full disk, and
leaves nothing behind. A loop device over a full filesystem loses its writes while `write()`
and `umount` succeed, so without the `syncfs` check the layer would have holes."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hashlib
import os
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from agentenv.oci import blocks
from agentenv.oci.blocks import ChainBuilder
from agentenv.oci.cache import ImageCache
from agentenv.oci.errors import OciError
from agentenv.storage.layers import LayerStore

from .images import Layer

MIB = 1024 * 1024


def _sh(args: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, timeout=30, check=False)


def _loops_into(path: Path) -> list[str]:
    out = subprocess.run(
        ["losetup", "--list", "--noheadings", "-O", "BACK-FILE"],
        capture_output=True, text=True, timeout=30, check=False,
    ).stdout  # fmt: skip
    return [ln for ln in out.splitlines() if str(path) in ln]


@contextlib.asynccontextmanager
async def _full_scratch(
    tmp_path: Path, layer: Layer
) -> AsyncIterator[tuple[ImageCache, Path, str]]:
    """A cache holding `layer`'s blob, its scratch dir a 48 MB tmpfs: (cache, blob, diff_id).
    Unmounted after; the layer left neither a chain record nor a stored layer."""
    data, diff_id, _ = layer.blob()
    cache = ImageCache(tmp_path / "oci", LayerStore(tmp_path / "layers"))
    cache.ensure_dirs()
    blob = cache.blob_path("sha256:" + hashlib.sha256(data).hexdigest())
    blob.write_bytes(data)
    scratch = cache.root / "tmp"
    scratch.mkdir()
    mounted = await asyncio.to_thread(
        _sh, ["mount", "-t", "tmpfs", "-o", "size=48m", "tmpfs", str(scratch)]
    )
    assert mounted.returncode == 0, mounted.stderr
    try:
        yield cache, blob, diff_id
        assert _loops_into(tmp_path) == []
    finally:
        (scratch / "filler").unlink(missing_ok=True)
        done = await asyncio.to_thread(_sh, ["umount", str(scratch)])
    assert done.returncode == 0, done.stderr
    assert list(cache.chains.iterdir()) == [] and LayerStore(tmp_path / "layers").digests() == []


async def test_full_scratch_disk_fails_the_layer(tmp_path: Path) -> None:
    unit = b"agentenv-fill-0123456789abcdef\n" * 4096
    big = Layer().dir("d").file("d/big", unit * (64 * MIB // len(unit)))
    async with _full_scratch(tmp_path, big) as (cache, blob, diff_id):
        lost = r"writing the filesystem failed: .*oci/tmp is full \(\d+ MB free\)"
        with pytest.raises(OciError, match=lost):
            await ChainBuilder(cache).ensure([(blob, diff_id)])
        assert list((cache.root / "tmp").iterdir()) == []
    # With room, the same layer builds.
    (layer,) = await ChainBuilder(cache).ensure([(blob, diff_id)])
    assert layer.used_bytes >= 60 * MIB


async def test_a_layer_gone_read_only_on_a_full_disk_names_the_disk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under load the kernel may write back before the extraction ends: ext4 then turns the
    layer read-only and the extraction's next write gets EROFS, before `syncfs` could report
    the lost write. The error is the same: the layer's write failed, and the full disk is named.
    (The extraction is replaced: when the kernel writes back is not the test's to choose.)"""
    small = Layer().dir("d").file("d/small", b"x" * 4096)
    async with _full_scratch(tmp_path, small) as (cache, blob, diff_id):
        filler = cache.root / "tmp" / "filler"

        def fill_then_read_only(mnt: Path, *args: object, **kw: object) -> None:
            with filler.open("wb", buffering=0) as out, contextlib.suppress(OSError):
                while True:
                    out.write(b"\0" * MIB)
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(mnt / "d" / "small"))

        monkeypatch.setattr(blocks, "apply_layer", fill_then_read_only)
        named = r"writing the filesystem failed: Read-only file system; .*oci/tmp is full"
        with pytest.raises(OciError, match=named):
            await ChainBuilder(cache).ensure([(blob, diff_id)])
