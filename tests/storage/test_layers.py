"""LayerStore and uppers against real qemu-img images."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from agentenv.storage import (
    DiskTooSmall,
    LayerInUse,
    LayerNotFound,
    LayerStore,
    create_upper,
    create_upper_sync,
    info,
)

MIB = 1024 * 1024


def qemu_io(image: Path, cmd: str, fmt: str = "qcow2") -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["qemu-io", "-f", fmt, "-c", cmd, str(image)], capture_output=True, text=True, check=False
    )


def make_raw(path: Path, size_mb: int, pattern: int) -> Path:
    with path.open("wb") as fh:
        fh.truncate(size_mb * MIB)
    assert qemu_io(path, f"write -P {pattern} 0 64k", fmt="raw").returncode == 0
    return path


def reads(image: Path, pattern: int, offset: int = 0) -> bool:
    out = qemu_io(image, f"read -P {pattern} {offset} 64k")
    return out.returncode == 0 and "Pattern verification failed" not in out.stdout


@pytest.fixture
def store(tmp_path: Path) -> LayerStore:
    return LayerStore(tmp_path / "layers")


def test_add_converts_raw_and_is_idempotent(store: LayerStore, tmp_path: Path) -> None:
    raw = make_raw(tmp_path / "base.raw", 8, 0x11)
    d1 = store.add(raw)
    d2 = store.add(raw)
    assert d1 == d2 and len(d1) == 64
    p = store.path(d1)
    assert p.name == f"{d1}.qcow2"
    assert info(p).format == "qcow2"
    assert p.stat().st_mode & 0o777 == 0o444
    assert reads(p, 0x11)
    assert store.digests() == [d1]
    # Adding the stored file itself yields the same layer.
    assert store.add(p) == d1


def test_add_rebases_child_onto_stored_parent(store: LayerStore, tmp_path: Path) -> None:
    raw = make_raw(tmp_path / "base.raw", 8, 0x11)
    base_q = tmp_path / "base.qcow2"
    subprocess.run(["qemu-img", "convert", "-O", "qcow2", raw, base_q], check=True)
    child = tmp_path / "child.qcow2"
    create_upper_sync(base_q, child)
    assert qemu_io(child, "write -P 0x22 1M 64k").returncode == 0

    child_digest = store.add(child)
    parent_digest = store.parent(child_digest)
    assert parent_digest is not None
    assert store.chain(child_digest) == [child_digest, parent_digest]
    assert info(store.path(child_digest)).backing_file == store.path(parent_digest)
    # The stored chain no longer depends on the source files.
    base_q.unlink()
    child.unlink()
    assert reads(store.path(child_digest), 0x11)
    out = qemu_io(store.path(child_digest), "read -P 0x22 1M 64k")
    assert "Pattern verification failed" not in out.stdout


def test_refs_protect_layers_and_gc_removes_the_rest(store: LayerStore, tmp_path: Path) -> None:
    base = store.add(make_raw(tmp_path / "a.raw", 4, 0x01))
    other = store.add(make_raw(tmp_path / "b.raw", 4, 0x02))
    upper = tmp_path / "u.qcow2"
    create_upper_sync(store.path(base), upper)
    child = store.add(upper)

    store.ref(child, "template:t1")
    # The child protects its parent through the chain; `other` is free.
    with pytest.raises(LayerInUse):
        store.remove(child)
    with pytest.raises(LayerInUse):
        store.remove(base)
    assert store.gc() == [other]
    assert set(store.digests()) == {base, child}

    # A second store object sees the persisted refs.
    again = LayerStore(store.root)
    assert again.holders(child) == ["template:t1"]
    again.unref(child, "template:t1")
    assert store.gc() == [child, base]
    assert store.digests() == []


def test_unref_holder_and_unknown_digest(store: LayerStore, tmp_path: Path) -> None:
    d = store.add(make_raw(tmp_path / "a.raw", 4, 0x01))
    e = store.add(make_raw(tmp_path / "b.raw", 4, 0x02))
    store.ref(d, "sbx-1")
    store.ref(d, "sbx-2")
    store.ref(e, "sbx-1")
    assert store.held_by("sbx-1") == sorted([d, e])
    assert store.unref_holder("sbx-1") == sorted([d, e])
    assert store.unheld([d, e]) == [e]
    assert store.holders(d) == ["sbx-2"]
    # A kill's release: its references gone, and those nobody else holds named.
    store.ref(d, "sbx-3")
    store.ref(e, "sbx-3")
    assert store.release("sbx-3") == [e]
    assert store.held_by("sbx-3") == [] and store.holders(d) == ["sbx-2"]
    assert store.held_by("sbx-1") == [] and store.held_by("sbx-2") == [d]
    with pytest.raises(LayerNotFound):
        store.path("0" * 64)
    with pytest.raises(LayerNotFound):
        store.ref("nope", "x")


async def test_upper_isolates_writes_and_grows(store: LayerStore, tmp_path: Path) -> None:
    base = store.path(store.add(make_raw(tmp_path / "a.raw", 8, 0x01)))
    u1, u2 = tmp_path / "u1.qcow2", tmp_path / "u2.qcow2"
    await create_upper(base, u1, 16)
    await create_upper(base, u2, None)
    assert info(u1).virtual_size == 16 * MIB
    assert info(u2).virtual_size == 8 * MIB
    assert info(u1).backing_file == base
    assert qemu_io(u1, "write -P 0x77 0 64k").returncode == 0
    assert reads(u1, 0x77)
    assert reads(u2, 0x01)
    assert reads(base, 0x01)


async def test_upper_smaller_than_base_is_refused(store: LayerStore, tmp_path: Path) -> None:
    base = store.path(store.add(make_raw(tmp_path / "a.raw", 8, 0x01)))
    dest = tmp_path / "u.qcow2"
    with pytest.raises(DiskTooSmall, match="smaller than"):
        await create_upper(base, dest, 4)
    assert not dest.exists()


def test_holds_of_a_store_written_before_them_are_kept(store: LayerStore, tmp_path: Path) -> None:
    """A data dir from before `Holds` has one `refs.json` table: its holds become files on
    the store's first use, and what they hold is kept by gc."""
    held = store.add(make_raw(tmp_path / "held.raw", 8, 0x21))
    loose = store.add(make_raw(tmp_path / "loose.raw", 8, 0x22))
    (store.root / "refs.json").write_text(f'{{"{held}": ["template:base", "i0abc"]}}')
    fresh = LayerStore(store.root)
    assert fresh.holders(held) == ["i0abc", "template:base"]
    assert not (store.root / "refs.json").exists()
    assert fresh.gc() == [loose]
    assert fresh.release("i0abc") == []
    assert fresh.release("template:base") == [held]
    assert fresh.gc() == [held] and fresh.digests() == []
