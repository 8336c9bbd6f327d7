"""Holds as files: any holder name, O(1) takes and drops, and what a store's lock relies on."""

from __future__ import annotations

from pathlib import Path

from agentenv.storage.holds import Holds

# Holder names as the node makes them, and ones that would be paths if written as they are.
ODD = ["i0abc", "snapshot:0123", "reset:i0abc", "a/b", ".", "..", ".hidden", "100%", "x y"]


def test_any_holder_name_is_one_file_inside_its_target(tmp_path: Path) -> None:
    holds = Holds(tmp_path / "holds")
    for holder in ODD:
        holds.add("t1", holder)
    holds.add("t2", "a/b")
    assert holds.holders("t1") == sorted(ODD)
    assert sorted(p.name for p in (tmp_path / "holds").iterdir()) == ["t1", "t2"]
    assert len(list((tmp_path / "holds" / "t1").iterdir())) == len(ODD)
    assert holds.held_by("a/b") == ["t1", "t2"]
    assert holds.all_holders() == set(ODD)
    holds.add("t1", "a/b")  # taken twice: still one hold
    assert holds.release("a/b") == ["t1", "t2"]
    assert holds.held_by("a/b") == [] and holds.targets() == ["t1"]
    for holder in ODD:
        assert holds.drop("t1", holder) is (holder != "a/b")
    assert not holds.held("t1") and holds.targets() == []
    # `held` removed the emptied directory; a take makes it again.
    assert not (tmp_path / "holds" / "t1").exists()
    holds.add("t1", "again")
    assert holds.held("t1")
    holds.forget("t1")
    assert holds.holders("t1") == [] and not (tmp_path / "holds" / "t1").exists()


def test_an_unknown_target_or_store_is_empty(tmp_path: Path) -> None:
    holds = Holds(tmp_path / "never-made")
    assert holds.holders("t") == [] and not holds.held("t") and holds.targets() == []
    assert holds.release("h") == [] and holds.drop("t", "h") is False
    holds.forget("t")
