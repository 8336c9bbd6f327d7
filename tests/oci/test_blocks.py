"""Block layers per chain prefix: built from a real registry pull, shared between images that
share their first layers, and holding exactly the tree the layers describe."""

from __future__ import annotations

import os
import stat
import subprocess
import time
from pathlib import Path

import pytest

from agentenv.oci import blocks
from agentenv.oci.blocks import chain_ids
from agentenv.oci.cache import CHAIN_HOLDER, ImageCache
from agentenv.oci.errors import DigestMismatch
from agentenv.oci.pull import pull
from agentenv.oci.unpack import apply_layer
from agentenv.storage import images as qimg

from .conftest import Images, Registries
from .images import Layer, Pusher


def _mounts_under(path: Path) -> list[str]:
    return [ln for ln in Path("/proc/self/mounts").read_text().splitlines() if str(path) in ln]


def _tree(root: Path) -> dict[str, tuple[object, ...]]:
    """Everything a layer sets, per path (lost+found belongs to ext4, not to the image)."""
    out: dict[str, tuple[object, ...]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            rel = str(p.relative_to(root))
            if rel == "lost+found" or rel.startswith("lost+found/"):
                continue
            st = p.lstat()
            kind = stat.S_IFMT(st.st_mode)
            extra: object = None
            if stat.S_ISREG(st.st_mode):
                extra = p.read_bytes()
            elif stat.S_ISLNK(st.st_mode):
                extra = os.readlink(p)
            elif stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode):
                extra = (os.major(st.st_rdev), os.minor(st.st_rdev))
            xattrs = (
                {}
                if stat.S_ISLNK(st.st_mode)
                else {a: os.getxattr(p, a, follow_symlinks=False) for a in os.listxattr(p)}
            )
            mtime = None if stat.S_ISDIR(st.st_mode) else st.st_mtime_ns
            out[rel] = (kind, stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid, extra,
                        tuple(sorted(xattrs.items())), mtime, st.st_nlink)  # fmt: skip
    return out


def _block_tree(layer_path: Path, scratch: Path) -> tuple[dict[str, tuple[object, ...]], str]:
    """The tree inside a block layer (through a throwaway overlay) and e2fsck's verdict."""
    scratch.mkdir()
    overlay = scratch / "check.qcow2"
    qimg.create_overlay_sync(layer_path, overlay)
    export = scratch / "disk.raw"
    with blocks._fuse_export(overlay, export, "check"):
        fsck = subprocess.run(
            ["e2fsck", "-fn", str(export)], capture_output=True, text=True, timeout=120
        )
        with blocks._loop_mounted(export, scratch / "mnt", "check"):
            tree = _tree(scratch / "mnt")
    return tree, f"{fsck.returncode} {fsck.stdout[-300:]}"


async def test_chain_layers_shared_and_exact(
    registries: Registries, images: Images, cache: ImageCache, tmp_path: Path
) -> None:
    t0 = time.monotonic()
    app = await pull(cache, f"{registries.open.host}/app:1", blocks=True)
    first = time.monotonic() - t0
    assert app.chain_ids == tuple(chain_ids(images.app.diff_ids))
    assert app.chain_ids[0] == images.app.diff_ids[0]
    assert len(app.layers) == 3
    store = cache.layers
    # Each block layer is a qcow2 over the one below.
    assert store.chain(app.layers[2]) == list(reversed(app.layers))
    for chain in app.chains:
        assert CHAIN_HOLDER + chain.chain_id in store.holders(chain.layer)
        assert qimg.info(store.path(chain.layer)).format == "qcow2"

    t1 = time.monotonic()
    other = await pull(cache, f"{registries.open.host}/other:1", blocks=True)
    second = time.monotonic() - t1
    # Same first two layers: same chain ids, the very same block layers.
    assert other.chain_ids[:2] == app.chain_ids[:2]
    assert other.layers[:2] == app.layers[:2]
    assert other.layers[2] != app.layers[2]
    assert other.chains[0].build_s == app.chains[0].build_s  # reused, not rebuilt
    assert len(store.digests()) == 4

    # What the block layer holds is exactly what applying the layers to a directory gives.
    ref_root = tmp_path / "ref"
    ref_root.mkdir()
    for blob, diff_id in zip(app.blob_paths, app.config.diff_ids, strict=True):
        apply_layer(ref_root, blob, diff_id=diff_id)
    tree, fsck = _block_tree(store.path(app.layers[2]), tmp_path / "check")
    assert fsck.startswith("0 "), fsck
    assert tree == _tree(ref_root)
    assert "usr/lib/extra.so" in tree and "etc/old" not in tree
    assert not _mounts_under(tmp_path)
    sizes = {c.chain_id[7:19]: (c.stored_bytes, c.build_s) for c in app.chains + other.chains}
    print(f"\nblock layers: app {first:.2f}s, other (2 shared) {second:.2f}s; {sizes}")


async def test_a_layer_that_does_not_fit_grows_the_filesystem(
    registries: Registries,
    images: Images,
    cache: ImageCache,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(blocks, "MIN_FS_BYTES", 0)
    monkeypatch.setattr(blocks, "FS_ROUND", 16 * blocks.MIB)
    monkeypatch.setattr(blocks, "FS_SLACK", 0)
    pusher = Pusher(registries.open.url)
    try:
        big = (images.big.layer_bytes[0], images.big.diff_ids[0], images.layers["l1"][2])
        pusher.image("grow", "1", [images.layers["l1"], big])
    finally:
        pusher.close()
    got = await pull(cache, f"{registries.open.host}/grow:1", blocks=True)
    bottom, top = got.chains
    assert bottom.virtual_size == 16 * blocks.MIB
    assert top.virtual_size > bottom.virtual_size
    assert qimg.info(cache.layers.path(top.layer)).virtual_size == top.virtual_size
    tree, fsck = _block_tree(cache.layers.path(top.layer), tmp_path / "check")
    assert fsck.startswith("0 "), fsck
    assert len(tree["big.bin"][4]) == 24 * 1024 * 1024  # type: ignore[arg-type]
    assert "usr/bin/tool" in tree
    assert not _mounts_under(tmp_path)
    print(f"\n24 MB layer over a grown fs: {top.build_s:.2f}s, {top.stored_bytes} bytes stored")


async def test_digest_of_uncompressed_layer_is_checked(
    registries: Registries, images: Images, cache: ImageCache
) -> None:
    pusher = Pusher(registries.open.url)
    try:
        data, _, media_type = Layer().file("x", b"x").blob("gzip")
        pusher.image("liar", "1", [(data, "sha256:" + "1" * 64, media_type)])
    finally:
        pusher.close()
    with pytest.raises(DigestMismatch, match="the image config says sha256:1111"):
        await pull(cache, f"{registries.open.host}/liar:1", blocks=True)
    assert cache.layers.digests() == []
    scratch = cache.root / "tmp"
    assert not scratch.exists() or not list(scratch.iterdir())


def test_umount_waits_out_a_process_inside_the_mount_and_then_names_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A process walking the mounted layer (du, an indexer) makes umount EBUSY for a moment:
    the unmount waits it out; one that stays past the limit is a clear error."""
    import threading

    from agentenv.oci.errors import OciError

    mnt = tmp_path / "mnt"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], check=True)
    try:
        fd = os.open(mnt, os.O_RDONLY | os.O_DIRECTORY)  # as a walker inside it would
        threading.Timer(0.3, os.close, (fd,)).start()
        blocks._umount(mnt, "layer x")
        assert not os.path.ismount(mnt)

        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], check=True)
        monkeypatch.setattr(blocks, "UMOUNT_BUSY_S", 0.3)
        fd = os.open(mnt, os.O_RDONLY | os.O_DIRECTORY)
        try:
            with pytest.raises(OciError, match=r"layer x: umount .* busy"):
                blocks._umount(mnt, "layer x")
        finally:
            os.close(fd)
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False, capture_output=True)
