"""The warm pool's bookkeeping without VMs: a named snapshot's shape joins at its second ask,
and the entries of all shapes together stay under the node's cap, the shape used longest
ago giving one up to a shape that has none."""

from __future__ import annotations

import asyncio
import itertools
from types import SimpleNamespace
from typing import Any

from agentenv.node.warm import Shape, WarmPool, snapshot_shape

TPL = Shape("base", 1, 512)
SNAP = snapshot_shape("task-state", 1, 512)


def _pool(**kw: Any) -> tuple[WarmPool, list[str]]:
    names = (f"e{i}" for i in itertools.count())
    dropped: list[str] = []

    async def make(snapshot_id: str) -> Any:
        vm = SimpleNamespace(exit_code=None, pid=1)
        return SimpleNamespace(name=next(names), snap=SimpleNamespace(id=snapshot_id), vm=vm)

    async def drop(prep: Any) -> None:
        dropped.append(prep.name)

    return WarmPool(1, 2, make, drop, **kw), dropped


async def _fill(pool: WarmPool) -> None:
    await pool._check()
    while await pool._refill_one():
        pass
    await asyncio.sleep(0)  # the discards' tasks


async def test_a_snapshot_shape_joins_at_its_second_ask() -> None:
    pool, _ = _pool()
    assert pool.take(SNAP, "s1", repeated=True) is None
    assert pool.shapes() == []
    assert pool.take(SNAP, "s1", repeated=True) is None
    assert pool.shapes() == [SNAP]
    await _fill(pool)
    assert len(pool.ready(SNAP)) == 2
    taken = pool.take(SNAP, "s1", repeated=True)
    assert taken is not None and taken.snap.id == "s1"
    # A template's shape joins at once.
    assert pool.take(TPL, "t1") is None and TPL in pool.shapes()


async def test_the_node_wide_cap_moves_entries_to_the_shape_in_use() -> None:
    pool, dropped = _pool(max_entries=3)
    pool.take(TPL, "t1")
    await _fill(pool)
    assert len(pool.ready(TPL)) == 2
    pool.take(SNAP, "s1", repeated=True)
    pool.take(SNAP, "s1", repeated=True)
    await _fill(pool)
    # One was free under the cap; at the cap a shape that has `low` entries waits.
    assert (len(pool.ready(TPL)), len(pool.ready(SNAP))) == (2, 1) and dropped == []
    assert pool.take(SNAP, "s1", repeated=True) is not None
    await _fill(pool)
    assert (len(pool.ready(TPL)), len(pool.ready(SNAP))) == (2, 1) and dropped == []
    # Below `low` at the cap: the shape used longest ago gives one up.
    pool.max_entries = 2
    assert pool.take(SNAP, "s1", repeated=True) is not None
    await _fill(pool)
    assert (len(pool.ready(TPL)), len(pool.ready(SNAP))) == (1, 1) and len(dropped) == 1
    # Never over the cap, however long it refills; the template's shape, used longer
    # ago, does not take it back.
    await _fill(pool)
    assert (len(pool.ready(TPL)), len(pool.ready(SNAP))) == (1, 1)
