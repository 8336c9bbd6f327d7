"""The file side of a fork of a paused sandbox (`snapshot.paused_capture`), no VM: the memory
file's clone keeps its data and its holes, and a pause that kept no memory is refused."""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path
from typing import cast

import pytest

from agentenv.files import SandboxFiles
from agentenv.snapshot import GuestImage, NoMemory, PausedState, SnapshotRepository
from agentenv.snapshot.paused_capture import capture_paused, clone_file
from agentenv.storage import LayerStore

MIB = 1024 * 1024


def test_clone_keeps_the_data_and_the_holes(tmp_path: Path) -> None:
    src = tmp_path / "memory"
    with src.open("wb") as fh:
        fh.truncate(64 * MIB)
        fh.seek(3 * MIB)
        fh.write(os.urandom(MIB))
        fh.seek(40 * MIB + 123)
        fh.write(b"tail of the touched RAM")
    dest = tmp_path / "clone"
    reflinked = clone_file(src, dest)
    assert dest.read_bytes() == src.read_bytes()
    if not reflinked:
        # A copy of the data extents only: the never-touched RAM stays a hole.
        assert dest.stat().st_blocks * 512 < 8 * MIB
    with pytest.raises(FileExistsError):
        clone_file(src, dest)


def test_an_empty_memory_file_clones_to_an_empty_one(tmp_path: Path) -> None:
    src = tmp_path / "memory"
    with src.open("wb") as fh:
        fh.truncate(4 * MIB)
    clone_file(src, tmp_path / "clone")
    assert (tmp_path / "clone").stat().st_size == 4 * MIB
    assert (tmp_path / "clone").read_bytes() == bytes(4 * MIB)


async def test_a_filesystem_only_pause_is_not_forked(tmp_path: Path) -> None:
    workdir = tmp_path / "sbx"
    workdir.mkdir()
    record = PausedState(
        name="sbx", vcpus=1, memory_mb=256, balloon=False, tools_image="/none", accel="tcg",
        qemu_version="8", kind="disk", upper="rootfs.qcow2", paused_at=0.0,
    )  # fmt: skip
    SandboxFiles(workdir).paused.write_text(json.dumps(asdict(record)))
    layers = LayerStore(tmp_path / "layers")
    repo = SnapshotRepository(tmp_path / "snapshots", layers)
    with pytest.raises(NoMemory, match="without its memory"):
        await capture_paused(workdir, repo, layers, cast(GuestImage, None))
    assert not list((tmp_path / "snapshots").glob("*")), "nothing staged"
