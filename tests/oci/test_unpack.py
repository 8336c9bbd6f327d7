"""Applying layer archives onto a directory: every entry type, whiteouts, and path safety."""

from __future__ import annotations

import os
import stat
import threading
from pathlib import Path

import pytest

from agentenv.oci.errors import DigestMismatch, LayerError
from agentenv.oci.unpack import apply_layer, scan_layer

from .conftest import base_layer, second_layer
from .images import MTIME, Layer


def _write(tmp: Path, layer: Layer, compression: str = "gzip") -> tuple[Path, str]:
    data, diff_id, _ = layer.blob(compression)
    path = tmp / f"blob-{diff_id[7:19]}"
    path.write_bytes(data)
    return path, diff_id


def _apply(tmp: Path, root: Path, layer: Layer, compression: str = "gzip") -> None:
    blob, diff_id = _write(tmp, layer, compression)
    stats = apply_layer(root, blob, diff_id=diff_id)
    assert stats.diff_id == diff_id


@pytest.mark.parametrize("compression", ["gzip", "zstd", "none"])
def test_base_layer_entries(tmp_path: Path, compression: str) -> None:
    root = tmp_path / "root"
    root.mkdir()
    _apply(tmp_path, root, base_layer(), compression)
    tool = root / "usr/bin/tool"
    assert tool.read_bytes() == b"#!/bin/sh\necho tool\n"
    assert stat.S_IMODE(tool.stat().st_mode) == 0o755
    assert os.getxattr(tool, "user.note") == b"hello"
    assert os.getxattr(tool, "trusted.t") == b"1"
    assert tool.stat().st_mtime == MTIME
    assert (root / "usr/bin/tool2").stat().st_ino == tool.stat().st_ino
    assert stat.S_IMODE((root / "usr/bin/su").stat().st_mode) == 0o4755
    home = root / "home/user"
    assert (home.stat().st_uid, home.stat().st_gid, stat.S_IMODE(home.stat().st_mode)) == (
        1000,
        1000,
        0o700,
    )
    assert (home / ".profile").stat().st_uid == 1000
    assert home.stat().st_mtime == MTIME  # directory times are set after their children
    null = (root / "dev/null").lstat()
    assert (
        stat.S_ISCHR(null.st_mode) and os.major(null.st_rdev) == 1 and os.minor(null.st_rdev) == 3
    )
    blk = (root / "dev/loopx").lstat()
    assert stat.S_ISBLK(blk.st_mode) and stat.S_IMODE(blk.st_mode) == 0o660
    assert stat.S_ISFIFO((root / "run/fifo").lstat().st_mode)
    assert os.readlink(root / "lib") == "usr/lib"
    assert os.readlink(root / "etc/abs-link") == "/etc/passwd"


def test_second_layer_whiteouts_opaque_and_symlinked_parents(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    _apply(tmp_path, root, base_layer())
    _apply(tmp_path, root, second_layer())
    # Written through lib -> usr/lib, inside the root.
    assert (root / "usr/lib/extra.so").read_bytes() == b"\x7fELF extra"
    assert os.path.islink(root / "lib")
    assert not (root / "etc/old").exists()
    assert sorted(os.listdir(root / "var/cache")) == ["z"]
    assert b"user:x:1000" in (root / "etc/passwd").read_bytes()
    # No marker files land in the tree.
    assert not list(root.rglob(".wh.*"))


def test_opaque_keeps_entries_of_the_same_layer_in_any_order(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    _apply(tmp_path, root, Layer().dir("d").file("d/old", b"1").dir("d/sub").file("d/sub/o", b"2"))
    # The new entries come before the opaque marker in the archive.
    _apply(tmp_path, root, Layer().file("d/sub/new", b"3").file("d/top", b"4").opaque("d"))
    assert sorted(os.listdir(root / "d")) == ["sub", "top"]
    assert sorted(os.listdir(root / "d/sub")) == ["new"]


def test_whiteout_then_recreate_and_type_changes(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    _apply(tmp_path, root, Layer().dir("a").file("a/f", b"x").file("b", b"file"))
    _apply(
        tmp_path, root, Layer().whiteout("a").file("a", b"now a file").dir("b").file("b/c", b"c")
    )
    assert (root / "a").read_bytes() == b"now a file"
    assert (root / "b/c").read_bytes() == b"c"


@pytest.mark.parametrize("name", ["../escape", "a/../../escape", "/../escape"])
def test_dotdot_names_are_refused(tmp_path: Path, name: str) -> None:
    root = tmp_path / "root"
    root.mkdir()
    blob, _ = _write(tmp_path, Layer().file(name, b"bad"))
    with pytest.raises(LayerError, match="climbs out of the root"):
        apply_layer(root, blob)
    assert not (tmp_path / "escape").exists()


def test_symlinks_cannot_lead_outside(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "victim").write_text("keep")
    _apply(
        tmp_path,
        root,
        Layer()
        .symlink("abs", str(outside))  # absolute: means <root><outside>
        .symlink("rel", "../../../../..")  # climbs: stops at the root
        .symlink("victim", str(outside / "victim")),
    )
    _apply(
        tmp_path,
        root,
        Layer()
        .file("abs/victim", b"owned")
        .file("rel/etc-file", b"in root")
        .file("victim", b"replaces the link, not its target")
        .hardlink("hl", "rel/etc-file"),
    )
    assert (outside / "victim").read_text() == "keep"
    assert sorted(os.listdir(outside)) == ["victim"]
    assert (root / str(outside).lstrip("/") / "victim").read_bytes() == b"owned"
    assert (root / "etc-file").read_bytes() == b"in root"
    assert not (root / "victim").is_symlink()
    assert (root / "hl").stat().st_ino == (root / "etc-file").stat().st_ino


def test_hardlink_to_outside_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    (tmp_path / "secret").write_text("s")
    blob, _ = _write(tmp_path, Layer().hardlink("h", "../secret"))
    with pytest.raises(LayerError, match="climbs out"):
        apply_layer(root, blob)
    blob2, _ = _write(tmp_path, Layer().symlink("s", str(tmp_path)).hardlink("h", "s/secret"))
    with pytest.raises(LayerError, match="hardlink"):
        apply_layer(root, blob2)
    assert (tmp_path / "secret").stat().st_nlink == 1


def test_diff_id_mismatch_and_garbage(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    blob, diff_id = _write(tmp_path, Layer().file("f", b"x"))
    with pytest.raises(DigestMismatch, match="config says sha256:0000"):
        apply_layer(root, blob, diff_id="sha256:" + "0" * 64)
    assert scan_layer(blob).diff_id == diff_id
    junk = tmp_path / "junk"
    junk.write_bytes(b"\x1f\x8b" + os.urandom(200))
    with pytest.raises(LayerError, match="not a valid layer archive"):
        apply_layer(root, junk)
    truncated = tmp_path / "truncated"
    truncated.write_bytes(blob.read_bytes()[:-20])
    with pytest.raises(LayerError):
        apply_layer(root, truncated)


@pytest.mark.parametrize("compression", ["gzip", "zstd"])
def test_in_process_decompression_when_the_zstd_cli_is_missing(
    tmp_path: Path, compression: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from agentenv.oci import layer_stream

    monkeypatch.setattr(layer_stream, "ZSTD_BIN", None)
    root = tmp_path / "root"
    root.mkdir()
    _apply(tmp_path, root, base_layer(), compression)
    assert (root / "usr/bin/tool").read_bytes() == b"#!/bin/sh\necho tool\n"


def test_a_bad_gzip_checksum_fails_after_the_last_entry(tmp_path: Path) -> None:
    # The tar parses to its end; only the decompressor's exit status says the data is bad.
    blob, diff_id = _write(tmp_path, Layer().file("f", b"payload " * 100))
    raw = bytearray(blob.read_bytes())
    raw[-8] ^= 0xFF  # the CRC32 in the gzip trailer
    blob.write_bytes(bytes(raw))
    root = tmp_path / "root"
    root.mkdir()
    with pytest.raises(LayerError, match="layer archive"):
        apply_layer(root, blob, diff_id=diff_id)
    with pytest.raises(LayerError, match="layer archive"):
        scan_layer(blob)
    # Neither failure leaves its hashing thread behind.
    assert not [t for t in threading.enumerate() if t.name == "layer-sha256"]


def test_progress_reports_uncompressed_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from agentenv.oci import layer_stream

    monkeypatch.setattr(layer_stream, "PROGRESS_EVERY", 64 * 1024)
    layer = Layer().file("a", os.urandom(3 * 1024 * 1024)).file("b", b"b" * 200_000)
    blob, diff_id = _write(tmp_path, layer)
    root = tmp_path / "root"
    root.mkdir()
    seen: list[int] = []
    stats = apply_layer(root, blob, diff_id=diff_id, progress=seen.append)
    assert len(seen) >= 3, seen
    assert seen == sorted(set(seen))
    assert seen[-1] == stats.uncompressed_bytes == len(layer.tar())
    assert scan_layer(blob, hash=False).uncompressed_bytes == stats.uncompressed_bytes


def test_a_directory_replaced_by_a_symlink_is_followed_afterwards(tmp_path: Path) -> None:
    # Directories are remembered between entries; one that is replaced must be forgotten,
    # so the entries below it go where the new symlink points (inside the root).
    root = tmp_path / "root"
    root.mkdir()
    layer = (
        Layer()
        .dir("d").file("d/a", b"a").dir("elsewhere")
        .symlink("d", "/elsewhere")
        .file("d/b", b"b")
    )  # fmt: skip
    _apply(tmp_path, root, layer)
    assert (root / "d").is_symlink()
    assert (root / "elsewhere/b").read_bytes() == b"b"
    assert not (root / "elsewhere/a").exists()
