"""SnapshotRepository on real files and a real layer store (no VM needed)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from agentenv.snapshot import (
    InvalidSnapshotName,
    Snapshot,
    SnapshotError,
    SnapshotNotFound,
    SnapshotRepository,
)
from agentenv.snapshot.digest import sparse_digest
from agentenv.storage import LayerStore

MIB = 1024 * 1024


@pytest.fixture
def layers(tmp_path: Path) -> LayerStore:
    return LayerStore(tmp_path / "layers")


@pytest.fixture
def repo(tmp_path: Path, layers: LayerStore) -> SnapshotRepository:
    return SnapshotRepository(tmp_path / "snapshots", layers)


@pytest.fixture
def layer(tmp_path: Path, layers: LayerStore) -> str:
    img = tmp_path / "disk.qcow2"
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", str(img), "8M"], check=True)
    return layers.add(img)


def stage(repo: SnapshotRepository, memory: bytes, state: bytes = b"device-state") -> Path:
    staging = repo.stage()
    with (staging / "memory").open("wb") as fh:
        fh.truncate(64 * MIB)  # mostly a hole, like a guest's untouched RAM
        fh.seek(MIB)
        fh.write(memory)
    (staging / "state").write_bytes(state)
    return staging


def draft(layer: str, names: list[str] | None = None, holders: list[str] | None = None) -> Snapshot:
    return Snapshot(
        id="",
        layers=[layer],
        vcpus=1,
        memory_mb=64,
        balloon=True,
        tools_image="/nonexistent/tools.ext4",
        accel="tcg",
        qemu_version="7.2.0",
        envd_version="0.6.4",
        memory_bytes=0,
        state_bytes=0,
        names=names or [],
        holders=holders or [],
    )


def test_content_addressed_commit(repo: SnapshotRepository, layer: str) -> None:
    a = repo.commit(stage(repo, b"ram"), draft(layer, ["one"]))
    assert len(a.id) == 32 and a.names == ["one"]
    assert a.state_bytes == len(b"device-state") and 0 < a.memory_bytes < MIB
    assert oct(repo.memory_path(a.id).stat().st_mode & 0o777) == "0o444"
    # The same content again is the same snapshot; the new name joins it.
    b = repo.commit(stage(repo, b"ram"), draft(layer, ["two"]))
    assert b.id == a.id and sorted(b.names) == ["one", "two"]
    c = repo.commit(stage(repo, b"other ram"), draft(layer))
    assert c.id != a.id
    assert repo.get("one").id == repo.get(a.id).id == a.id
    assert f"snapshot:{a.id}" in repo.layers.holders(layer)
    assert not list(repo.root.glob(".staging-*"))


def test_filesystem_only_snapshot_is_its_layers(repo: SnapshotRepository, layer: str) -> None:
    """`memory=False`: no RAM image or state is staged or kept; the id is the layers' and
    shape's, so the same disk captured twice is one snapshot, and it never equals a memory
    snapshot of the same layers."""
    from dataclasses import replace

    disk = replace(draft(layer, ["fs"]), memory=False)
    a = repo.commit(repo.stage(), disk)
    assert a.memory is False and a.memory_bytes == a.state_bytes == 0
    assert not repo.memory_path(a.id).exists() and not repo.state_path(a.id).exists()
    b = repo.commit(repo.stage(), replace(disk, names=["fs2"]))
    assert b.id == a.id and sorted(b.names) == ["fs", "fs2"]
    full = repo.commit(stage(repo, b"ram"), draft(layer))
    assert full.id != a.id and full.memory is True
    # It survives a catalog round trip as what it is.
    assert repo.get("fs").memory is False
    assert f"snapshot:{a.id}" in repo.layers.holders(layer)
    repo.delete("fs2")
    assert not (repo.root / a.id).exists()
    assert f"snapshot:{a.id}" not in repo.layers.holders(layer)


def test_names_move_like_tags(repo: SnapshotRepository, layer: str) -> None:
    a = repo.commit(stage(repo, b"a"), draft(layer, ["latest"]))
    b = repo.commit(stage(repo, b"b"), draft(layer, ["latest"]))
    assert repo.get("latest").id == b.id
    assert repo.get(a.id).names == []
    with pytest.raises(InvalidSnapshotName, match="invalid template name"):
        repo.add_name(b.id, "Bad Name!")
    with pytest.raises(SnapshotNotFound, match="does not exist"):
        repo.get("nope")


def test_delete_hides_a_mapped_snapshot_until_gc(repo: SnapshotRepository, layer: str) -> None:
    snap = repo.commit(stage(repo, b"x"), draft(layer, ["s"], holders=["sandbox-1"]))
    repo.delete("s")
    with pytest.raises(SnapshotNotFound):
        repo.get(snap.id)
    assert snap.id not in [s.id for s in repo.list()]
    assert repo.memory_path(snap.id).exists(), "a sandbox still maps it"
    assert repo.gc() == []
    repo.unref_holder("sandbox-1")
    assert repo.gc() == [snap.id]
    assert not (repo.root / snap.id).exists()
    assert f"snapshot:{snap.id}" not in repo.layers.holders(layer)


def test_release_drops_a_holder_and_what_only_it_kept(repo: SnapshotRepository, layer: str) -> None:
    shared = repo.commit(stage(repo, b"s"), draft(layer, holders=["sb-1", "sb-2"]))
    only = repo.commit(stage(repo, b"o"), draft(layer, holders=["sb-1"]))
    named = repo.commit(stage(repo, b"n"), draft(layer, ["keep"], holders=["sb-1"]))
    assert repo.release("sb-1") == [only.id]
    assert not (repo.root / only.id).exists()
    assert {s.id: s.holders for s in repo.list()} == {shared.id: ["sb-2"], named.id: []}


def test_gc_keeps_named_and_held(repo: SnapshotRepository, layer: str) -> None:
    named = repo.commit(stage(repo, b"n"), draft(layer, ["keep"]))
    held = repo.commit(stage(repo, b"h"), draft(layer, holders=["sb"]))
    loose = repo.commit(stage(repo, b"l"), draft(layer))
    assert repo.gc() == [loose.id]
    assert {s.id for s in repo.list()} == {named.id, held.id}
    repo.delete("keep")
    assert not (repo.root / named.id).exists()


def test_commit_refuses_incomplete_or_bad_input(repo: SnapshotRepository, layer: str) -> None:
    staging = repo.stage()
    (staging / "memory").write_bytes(b"ram")
    with pytest.raises(SnapshotError, match="has no state"):
        repo.commit(staging, draft(layer))
    (staging / "state").write_bytes(b"s")
    with pytest.raises(InvalidSnapshotName):
        repo.commit(staging, draft(layer, ["UPPER"]))
    repo.discard(staging)
    assert not staging.exists() and repo.list() == []


def test_corrupt_catalog_is_reported(repo: SnapshotRepository, layer: str) -> None:
    repo.commit(stage(repo, b"x"), draft(layer))
    (repo.root / "catalog.json").write_text("{not json")
    with pytest.raises(SnapshotError, match="corrupt"):
        repo.list()


def test_sparse_digest_follows_data_and_offsets(tmp_path: Path) -> None:
    def sparse(name: str, at: int, data: bytes) -> Path:
        p = tmp_path / name
        with p.open("wb") as fh:
            fh.truncate(16 * MIB)
            fh.seek(at)
            fh.write(data)
        return p

    a = sparse("a", MIB, b"x" * 4096)
    assert sparse_digest(a) == sparse_digest(sparse("b", MIB, b"x" * 4096))
    assert sparse_digest(a) != sparse_digest(sparse("c", 2 * MIB, b"x" * 4096))
    assert sparse_digest(a) != sparse_digest(sparse("d", MIB, b"y" * 4096))
    empty = tmp_path / "e"
    with empty.open("wb") as fh:
        fh.truncate(MIB)
    assert os.stat(empty).st_blocks == 0 and sparse_digest(empty)


def test_adopt_finds_the_snapshot_files_elsewhere_would_make(
    repo: SnapshotRepository, layer: str, tmp_path: Path
) -> None:
    """`adopt` (a fork of a paused sandbox forked before): the same memory and state, found
    where they are, name the snapshot already committed and its holders take it; anything
    else is None, and nothing is staged or copied either way."""
    elsewhere = stage(repo, b"paused ram")
    memory, state = tmp_path / "memory", tmp_path / "state"
    os.rename(elsewhere / "memory", memory)
    os.rename(elsewhere / "state", state)
    repo.discard(elsewhere)
    assert repo.adopt(draft(layer, holders=["kid-1"]), memory, state) is None
    made = repo.commit(stage(repo, b"paused ram"), draft(layer, holders=["claim-1"]))
    again = repo.adopt(draft(layer, holders=["claim-2"]), memory, state)
    assert again is not None and again.id == made.id
    assert sorted(repo.get(made.id).holders) == ["claim-1", "claim-2"]
    other = tmp_path / "other"
    other.write_bytes(b"other ram")
    assert repo.adopt(draft(layer, holders=["claim-3"]), other, state) is None
    assert not list(repo.root.glob(".staging-*"))
    # Once gone from the repository it is not found again.
    for holder in ("claim-1", "claim-2"):
        repo.unref(made.id, holder)
    assert made.id in repo.gc()
    assert repo.adopt(draft(layer), memory, state) is None


def test_holders_of_a_catalog_written_before_holds_are_kept(
    repo: SnapshotRepository, layer: str
) -> None:
    """A catalog from before `storage.holds` lists holders in its entries: they count at
    once, become holds at the first change, and leave the catalog."""
    snap = repo.commit(stage(repo, b"m"), draft(layer))
    catalog = repo.root / "catalog.json"
    doc = json.loads(catalog.read_text())
    doc["snapshots"][0]["holders"] = ["sb-1", "sb-2"]
    catalog.write_text(json.dumps(doc))
    assert repo.get(snap.id).holders == ["sb-1", "sb-2"]
    assert repo.all_holders() >= {"sb-1", "sb-2"}
    assert repo.release("sb-1") == []
    assert json.loads(catalog.read_text())["snapshots"][0]["holders"] == []
    assert repo.get(snap.id).holders == ["sb-2"]
    assert repo.release("sb-2") == [snap.id]
    assert not (repo.root / snap.id).exists() and repo.holds.targets() == []
