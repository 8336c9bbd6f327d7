"""A replica's watched copy of an etcd directory (`cluster.mirror`), and the placement reads
that answer from one: what it answers in step, out of step, after a forget and after a lease
lapses."""

from __future__ import annotations

from typing import Any

import pytest

from agentenv.cluster.etcd import Etcd
from agentenv.cluster.locations import Locations
from agentenv.cluster.membership import Membership
from agentenv.cluster.mirror import PrefixMirror

from .helpers import registered, wait_until

# grpc.aio delivers completions to the loop a call started on; one loop for every test here
# (see conftest.py).
pytestmark = pytest.mark.asyncio(loop_scope="session")

TIMEOUT_S = 10.0


async def _in_step(*mirrors: PrefixMirror) -> None:
    async def ready() -> bool:
        return all(m.in_step for m in mirrors)

    await wait_until(ready, TIMEOUT_S, interval_s=0.02)


def _no_reads(*_: Any, **__: Any) -> Any:
    raise AssertionError("read etcd: the mirror should have answered")


async def test_a_mirror_follows_its_directory_and_knows_nothing_out_of_step(etcd: Etcd) -> None:
    things = etcd.dir("things")
    a, b = etcd.key("things", "a"), etcd.key("things", "b")
    await etcd.put(a, b"1")
    mirror = PrefixMirror(etcd, things, "things")
    assert mirror.under(things) is None and mirror.get(a) == (False, None)
    mirror.start()
    try:
        await _in_step(mirror)
        assert [(kv.key, kv.value) for kv in mirror.under(things) or []] == [(a, b"1")]
        await etcd.put(b, b"2")
        await etcd.put(etcd.key("other", "c"), b"3")  # not under the directory

        async def two() -> bool:
            return len(mirror.under(things) or []) == 2

        await wait_until(two, TIMEOUT_S, interval_s=0.02)
        await etcd.delete(a)

        async def only_b() -> bool:
            return [kv.key for kv in mirror.under(things) or []] == [b]

        await wait_until(only_b, TIMEOUT_S, interval_s=0.02)
        assert mirror.get(a) == (True, None)
        found, kv = mirror.get(b)
        assert found and kv is not None and kv.value == b"2"
        with pytest.raises(ValueError):
            mirror.under(etcd.dir("other"))
    finally:
        await mirror.stop()
    assert mirror.under(things) is None and mirror.get(b) == (False, None)


async def test_a_forgotten_key_is_not_known_until_its_next_change(etcd: Etcd) -> None:
    things = etcd.dir("things")
    a = etcd.key("things", "a")
    await etcd.put(a, b"old")
    mirror = PrefixMirror(etcd, things, "things")
    mirror.start()
    try:
        await _in_step(mirror)
        mirror.forget(a)
        # This replica's own write is on its way: neither the key nor its directory is
        # answered from the copy from before it.
        assert mirror.get(a) == (False, None) and mirror.under(things) is None
        await etcd.put(a, b"new")

        async def known() -> bool:
            return mirror.get(a)[0]

        await wait_until(known, TIMEOUT_S, interval_s=0.02)
        kv = mirror.get(a)[1]
        assert kv is not None and kv.value == b"new"
    finally:
        await mirror.stop()


async def test_placement_reads_answer_from_mirrors_and_follow_a_lapsed_lease(
    etcd: Etcd, monkeypatch: pytest.MonkeyPatch
) -> None:
    node = await registered(etcd, "node-a", ttl_s=2)
    members = Membership(etcd, mirrored=True)
    reader = Locations(etcd, mirrored=True)
    assert members.mirrors is not None and reader.mirror is not None
    mirrors = [*members.mirrors, reader.mirror]
    try:
        await Locations(etcd, node).add("snapshot", "snap-1")
        for mirror in mirrors:
            mirror.start()
        await _in_step(*mirrors)
        monkeypatch.setattr(etcd, "get_prefix", _no_reads)
        monkeypatch.setattr(etcd, "txn", _no_reads)

        async def held() -> bool:
            return await reader.holders("snapshot", "snap-1") == ["node-a"]

        await wait_until(held, TIMEOUT_S, interval_s=0.02)
        nodes = await members.list_nodes()
        assert [(n.node_id, n.cordoned) for n in nodes] == [("node-a", False)]
        monkeypatch.undo()
        # This replica's own cordon holds at once: read from etcd until the watch has it.
        # Whether the watch or the write's answer comes first is etcd's timing; what makes
        # the read go to etcd is that the cordon marks its key not known.
        forgotten: list[bytes] = []
        cordons = members.mirrors[1]
        forget = cordons.forget
        monkeypatch.setattr(cordons, "forget", lambda key: (forgotten.append(key), forget(key)))
        await members.cordon("node-a", "test")
        assert forgotten == [etcd.key("cordons", "node-a")]
        assert [n.cordoned for n in await members.list_nodes()] == [True]
        monkeypatch.undo()

        async def mirrored() -> bool:
            return members.mirrors is not None and bool(
                members.mirrors[1].under(etcd.dir("cordons"))
            )

        await wait_until(mirrored, TIMEOUT_S, interval_s=0.02)
        monkeypatch.setattr(etcd, "get_prefix", _no_reads)
        monkeypatch.setattr(etcd, "txn", _no_reads)
        assert [n.cordoned for n in await members.list_nodes()] == [True]
        await node.stop(deregister=False)  # dies without a word: only the lease ends it

        async def gone() -> bool:
            # Only reads that order nodes take the mirror's "none" as it is; the others
            # read etcd for it (a copy published a moment ago must be found).
            return await reader.holders("snapshot", "snap-1", preference=True) == [] and not (
                members.mirrors and members.mirrors[0].under(etcd.dir("nodes"))
            )

        await wait_until(gone, 2 + TIMEOUT_S, interval_s=0.05)
        with pytest.raises(AssertionError, match="read etcd"):
            await reader.holders("snapshot", "snap-1")
    finally:
        monkeypatch.undo()
        for mirror in mirrors:
            await mirror.stop()
        await node.stop()
    # Stopped mirrors answer nothing: the reads go to etcd again.
    assert await reader.holders("snapshot", "snap-1") == []
