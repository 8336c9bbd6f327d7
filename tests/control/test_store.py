"""The store's contract, run against both implementations (`SqliteStore`, `EtcdStore`; the
`store`/`open_store` fixtures in conftest.py), plus what only one of them has: SQLite's
migrations of older files, etcd's replicas, leader loss and bounded logs."""

from __future__ import annotations

import asyncio
import json
import sqlite3
import time
from pathlib import Path
from typing import Any

import pytest
from cluster.etcd_cluster import EtcdCluster
from cluster.helpers import wait_until

from agentenv.cluster.etcd import Etcd
from agentenv.control import etcd_store
from agentenv.control.etcd_kv import DuplicateKey
from agentenv.control.etcd_store import EtcdStore
from agentenv.control.sqlite_store import SqliteStore
from agentenv.control.store import BUILD_METADATA, DEFAULT_TEAM, SandboxRecord, SandboxState, Store

from .conftest import OpenStore

# The sandboxes table as the first schema made it (before auto_pause_memory and pause_mode).
_OLD_TABLE = """
CREATE TABLE sandboxes (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT NOT NULL UNIQUE, template TEXT NOT NULL,
    alias TEXT NOT NULL, state TEXT NOT NULL, started_at REAL NOT NULL, end_at REAL NOT NULL,
    cpu INTEGER NOT NULL, memory_mb INTEGER NOT NULL, disk_mb INTEGER NOT NULL,
    envd_version TEXT NOT NULL, metadata TEXT NOT NULL, env_vars TEXT NOT NULL,
    envd_token TEXT, traffic_token TEXT, auto_pause INTEGER NOT NULL,
    auto_resume INTEGER NOT NULL, allow_internet INTEGER NOT NULL, network TEXT NOT NULL,
    address TEXT, envd_url TEXT, runtime_id TEXT, api_key_id TEXT
);
INSERT INTO sandboxes (id, template, alias, state, started_at, end_at, cpu, memory_mb,
    disk_mb, envd_version, metadata, env_vars, auto_pause, auto_resume, allow_internet, network)
VALUES ('iold', 'base', 'base', 'paused', 1.0, 2.0, 1, 512, 1024, '0.6.4', '{}', '{}', 1, 0, 1,
    '{}');
"""

R, P, G = SandboxState.RUNNING, SandboxState.PAUSED, SandboxState.GONE


def _record(sandbox_id: str, **changes: object) -> SandboxRecord:
    rec = SandboxRecord(
        id=sandbox_id,
        template="base",
        alias="base",
        state=SandboxState.RUNNING,
        started_at=1.0,
        end_at=2.0,
        cpu=1,
        memory_mb=512,
        disk_mb=1024,
        envd_version="0.6.4",
    )
    for key, value in changes.items():
        setattr(rec, key, value)
    return rec


async def test_an_older_database_gets_the_new_columns(tmp_path: Path) -> None:
    db = tmp_path / "agentenv.db"
    with sqlite3.connect(db) as conn:
        conn.executescript(_OLD_TABLE)
    store = SqliteStore(db)
    old = await store.get("iold")
    # A row from before: its auto-pause kept memory, its pause mode is unknown, no replica.
    assert old is not None and old.auto_pause_memory is True and old.pause_mode is None
    assert old.replica_id is None
    await store.insert(_record("inew", auto_pause_memory=False))
    assert await store.transition("inew", R, P, pause_mode="filesystem")
    new = await store.get("inew")
    assert new is not None
    assert (new.auto_pause_memory, new.pause_mode) == (False, "filesystem")
    await store.close()
    # Opening it again adds nothing twice.
    again = SqliteStore(db)
    assert await again.get("inew") == new
    await again.close()


async def test_an_older_database_loses_the_nodes_own_ids(tmp_path: Path) -> None:
    """A data dir from when the node named sandboxes itself: the column of node ids is
    dropped (the sandbox id is the node's), the rows and their spawn counts stay."""
    db = tmp_path / "agentenv.db"
    with sqlite3.connect(db) as conn:
        conn.executescript(_OLD_TABLE)
        conn.execute(
            "INSERT INTO sandboxes (id, template, alias, state, started_at, end_at, cpu, "
            "memory_mb, disk_mb, envd_version, metadata, env_vars, auto_pause, auto_resume, "
            "allow_internet, network, address, envd_url, runtime_id) VALUES ('irun', 'base', "
            "'base', 'running', 3.0, 9.0, 1, 512, 1024, '0.6.4', '{}', '{}', 0, 0, 1, '{}', "
            "'10.0.0.2', 'http://10.0.0.2:49983', 'irun')"
        )
    store = SqliteStore(db)
    columns = {row[1] for row in store._db.execute("PRAGMA table_info(sandboxes)")}
    assert "runtime_id" not in columns and {"envd_url", "node_id", "team_id"} <= columns
    run = await store.get("irun")
    assert run is not None and run.state is R and run.envd_url == "http://10.0.0.2:49983"
    # The paused row never ran here as far as the store knows (no envd_url): no spawn.
    assert await store.spawns() == {"base": (1, 3.0)}
    await store.insert(_record("inew", envd_url="http://e"))
    assert await store.transition("inew", R, G)
    await store.close()
    again = SqliteStore(db)
    assert [r.id for r in await again.select()] == ["iold", "irun", "inew"]
    await again.close()


async def test_an_older_etcd_row_is_read_and_rewritten_without_the_nodes_id(
    store: Store,
) -> None:
    """On etcd, a row written when the node had its own id for the sandbox: read past, and
    gone from the row after its next write. (On SQLite, the test above.)"""
    if not isinstance(store, EtcdStore):
        pytest.skip("etcd rows only")
    await store.insert(_record("iold", envd_url="http://e", started_at=4.0))
    key = store._live("iold")
    kv = await store.etcd.get(key)
    assert kv is not None
    old = json.loads(kv.value) | {"runtime_id": "i-node-own-id"}
    await store.etcd.put(key, json.dumps(old).encode())
    rec = await store.get("iold")
    assert rec is not None and rec.envd_url == "http://e"
    assert await store.spawns() == {"base": (1, 4.0)}
    assert await store.transition("iold", R, P, address=None)
    kv = await store.etcd.get(key)
    assert kv is not None and "runtime_id" not in json.loads(kv.value)
    assert json.loads(kv.value)["state"] == P.value


# -- the contract, on both stores ----------------------------------------------------------


async def test_rows_round_trip_and_seq_follows_insertion(store: Store) -> None:
    rec = _record(
        "ia",
        metadata={"k": "v"},
        env_vars={"E": "1"},
        network={"allowPublicTraffic": False, "allowOut": ["1.2.3.4"]},
        envd_token="tok",
        traffic_token="traffic",
        auto_pause=True,
        auto_resume=True,
        allow_internet=False,
        api_key_id="kx",
        team_id="tx",
        auto_pause_memory=False,
        replica_id="r1",
    )
    await store.insert(rec)
    got = await store.get("ia")
    assert got == rec and got is not rec and rec.seq > 0
    second = _record("ib")
    await store.insert(second)
    assert second.seq > rec.seq
    assert await store.get("nope") is None
    with pytest.raises((DuplicateKey, sqlite3.IntegrityError)):
        await store.insert(_record("ia"))


async def test_transition_is_a_compare_and_set(store: Store) -> None:
    await store.insert(_record("ia"))
    assert await store.transition("ia", R, SandboxState.PAUSING)
    assert not await store.transition("ia", R, SandboxState.KILLING)
    # Any of several expected states; the changes come with the move.
    assert await store.transition(
        "ia", [R, SandboxState.PAUSING], P, address=None, end_at=5.0, pause_mode="full"
    )
    got = await store.get("ia")
    assert got is not None and (got.state, got.end_at, got.pause_mode) == (P, 5.0, "full")
    assert not await store.transition("missing", R, P)
    # A gone row is still there (history: the lost reason, spawn counts) and keeps its seq.
    seq = got.seq
    assert await store.transition("ia", P, G)
    gone = await store.get("ia")
    assert gone is not None and gone.state is G and gone.seq == seq
    await store.update("ia", envd_token="after")
    gone = await store.get("ia")
    assert gone is not None and gone.envd_token == "after" and gone.seq == seq


async def test_update_changes_only_the_named_fields(store: Store) -> None:
    await store.insert(_record("ia", network={"a": 1}))
    await store.update("ia", end_at=9.0, network={"b": 2}, auto_pause=True)
    got = await store.get("ia")
    assert got is not None and (got.end_at, got.network, got.auto_pause) == (9.0, {"b": 2}, True)
    assert got.state is R
    await store.update("missing", end_at=1.0)  # nothing to update: no error, nothing made
    assert await store.get("missing") is None


async def test_select_filters_and_pages(store: Store) -> None:
    for i, (state, team) in enumerate([(R, "ta"), (P, "ta"), (G, "tb"), (R, "tb")]):
        await store.insert(_record(f"i{i}", state=state, team_id=team))
    everything = await store.select()
    assert [r.id for r in everything] == ["i0", "i1", "i2", "i3"]
    seqs = [r.seq for r in everything]
    assert [r.id for r in await store.select([R])] == ["i0", "i3"]
    assert [r.id for r in await store.select([G])] == ["i2"]
    assert [r.id for r in await store.select([R, P], team_id="ta")] == ["i0", "i1"]
    assert [r.id for r in await store.select(descending=True)] == ["i3", "i2", "i1", "i0"]
    assert [r.id for r in await store.select(after_seq=seqs[1])] == ["i2", "i3"]
    assert [r.id for r in await store.select(before_seq=seqs[2], descending=True)] == [
        "i1",
        "i0",
    ]
    assert await store.select(team_id="nobody") == []


async def test_live_queries(store: Store) -> None:
    now = time.time()
    await store.insert(_record("irun", end_at=now - 1, envd_token="t1"))
    await store.insert(_record("ilater", end_at=now + 100))
    await store.insert(_record("ipaused", state=P, end_at=now - 50, envd_token="t3"))
    await store.insert(_record("igone", state=G, envd_token="t4"))
    await store.insert(_record("ibuild", metadata={BUILD_METADATA: "b1"}, end_at=now + 5))
    assert sorted(await store.envd_tokens()) == [("ipaused", "t3"), ("irun", "t1")]
    assert [r.id for r in await store.expired(now)] == ["irun"]
    assert await store.next_deadline() == pytest.approx(now - 1)
    # Build sandboxes are not users' sandboxes: counted apart.
    assert await store.count_by_state() == {"running": 2, "paused": 1, "gone": 1}
    assert await store.count_builds() == 1
    count, soonest = await store.count_active(DEFAULT_TEAM)
    assert count == 2 and soonest == pytest.approx(now - 1)
    assert await store.count_active("nobody") == (0, None)


async def test_spawns_count_started_sandboxes_per_template_and_team(store: Store) -> None:
    await store.insert(_record("i1", template="a", envd_url="http://x", started_at=5.0))
    await store.insert(_record("i2", template="a", envd_url="http://y", started_at=7.0, state=G))
    await store.insert(_record("i3", template="a", envd_url=None))  # a failed create
    await store.insert(_record("i4", template="b", envd_url="e", started_at=3.0, team_id="t"))
    await store.insert(_record("i5", template="b", envd_url="e", metadata={BUILD_METADATA: "1"}))
    assert await store.spawns() == {"a": (2, 7.0), "b": (1, 3.0)}
    assert await store.spawns("t") == {"b": (1, 3.0)}
    assert await store.spawns(DEFAULT_TEAM) == {"a": (2, 7.0)}


async def test_logs_in_order_from_a_start_time(store: Store) -> None:
    await store.insert(_record("ia"))
    for n in range(5):
        await store.log("ia", f"line {n}", "warn" if n == 3 else "info")
    lines = await store.logs("ia")
    assert [ln.message for ln in lines] == [f"line {n}" for n in range(5)]
    assert lines[3].level == "warn" and lines[0].sandbox_id == "ia"
    assert [ln.message for ln in await store.logs("ia", limit=2)] == ["line 0", "line 1"]
    assert next(ln.message for ln in await store.logs("ia", start=lines[2].ts)) == "line 2"
    assert await store.logs("other") == []


async def test_a_note_is_written_with_the_row_it_goes_with(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A lifecycle line given with an insert or a transition is written by that same write
    (on etcd: no write of its own), and by a transition only if the row moved."""
    if isinstance(store, EtcdStore):

        async def no_put(*args: object, **kwargs: object) -> None:
            raise AssertionError("a note was written on its own")

        monkeypatch.setattr(store.etcd, "put", no_put)
    await store.insert(_record("inote"), note="made")
    assert await store.transition("inote", R, P, note="paused", end_at=3.0)
    assert not await store.transition("inote", R, P, note="not moved")
    got = await store.get("inote")
    assert got is not None and (got.state, got.end_at) == (P, 3.0)
    assert [ln.message for ln in await store.logs("inote")] == ["made", "paused"]


async def test_teams(store: Store) -> None:
    default = await store.team(DEFAULT_TEAM)
    assert default is not None and default.name == DEFAULT_TEAM
    team = await store.add_team("tb", "bravo/with slash")
    assert await store.team("tb") == team
    assert await store.team("bravo/with slash") == team
    assert await store.team("nobody") is None
    assert [t.id for t in await store.teams()] == [DEFAULT_TEAM, "tb"]
    assert await store.set_team_limits("tb", max_sandboxes=3, creates_per_minute=None)
    assert await store.set_team_limits("tb", max_sandboxes=None, creates_per_minute=7)
    got = await store.team("tb")
    assert got is not None and (got.max_sandboxes, got.creates_per_minute) == (3, 7)
    assert not await store.set_team_limits("nobody", max_sandboxes=1, creates_per_minute=None)
    with pytest.raises((DuplicateKey, sqlite3.IntegrityError)):
        await store.add_team("tc", "bravo/with slash")


async def test_snapshot_owners(store: Store) -> None:
    assert await store.snapshot_owner("snap-1") == DEFAULT_TEAM
    await store.set_snapshot_owner("snap-1", "tb")
    assert await store.snapshot_owner("snap-1") == "tb"


async def test_api_keys(store: Store) -> None:
    key = await store.add_key("k1", "first", "e2b_abcd", "hash1", "tb")
    await store.add_key("k2", "second", "e2b_efgh", "hash2")
    assert await store.key("k1") == key and await store.key_by_hash("hash1") == key
    assert await store.key_by_hash("nope") is None and await store.key("nope") is None
    assert [k.id for k in await store.keys()] == ["k1", "k2"]
    assert await store.revoke_key("k1")
    assert not await store.revoke_key("k1")
    assert not await store.revoke_key("nope")
    revoked = await store.key_by_hash("hash1")
    assert revoked is not None and revoked.revoked_at is not None


async def test_idempotency_keys(store: Store) -> None:
    assert await store.claim_idempotency("k1", "a/b key", "h1")
    assert not await store.claim_idempotency("k1", "a/b key", "h2")
    assert await store.idempotency("k1", "a/b key") == ("h1", None)
    assert await store.idempotency("k2", "a/b key") is None
    # A release drops only a claim whose create did not finish.
    await store.complete_idempotency("k1", "a/b key", "isbx")
    await store.release_idempotency("k1", "a/b key")
    assert await store.idempotency("k1", "a/b key") == ("h1", "isbx")
    assert await store.claim_idempotency("k1", "other", "h3")
    await store.release_idempotency("k1", "other")
    assert await store.idempotency("k1", "other") is None
    await store.expire_idempotency(time.time() + 1)
    assert await store.idempotency("k1", "a/b key") is None


async def test_a_second_store_on_the_same_state_sees_every_write(open_store: OpenStore) -> None:
    """Two SQLite connections to one file, or two replicas on one etcd."""
    a, b = open_store(), open_store()
    await a.insert(_record("ia"))
    await a.log("ia", "made by a")
    await a.add_key("k1", "n", "p", "h")
    seen = await b.get("ia")
    assert seen is not None and seen.state is R
    assert [ln.message for ln in await b.logs("ia")] == ["made by a"]
    assert await b.transition("ia", R, P)
    got = await a.get("ia")
    assert got is not None and got.state is P
    assert await b.revoke_key("k1") and not await a.revoke_key("k1")


async def test_a_revoked_key_fails_at_every_replica_and_a_new_one_works_at_once(
    open_store: OpenStore,
) -> None:
    """Two replicas (or SQLite connections), each opened: on etcd the key check answers
    from a watched copy of the hashes (`EtcdKeys.key_hashes`)."""
    a, b = open_store(), open_store()
    await a.open()
    await b.open()
    await a.add_key("k1", "n", "p", "h1")
    await a.add_key("k2", "n", "p", "h2")
    got = await b.key_by_hash("h1")  # made at a: works at b at once, in step or not
    assert got is not None and got.revoked_at is None
    if isinstance(b, EtcdStore):
        at = b._hash_key("h1")

        async def b_has_it() -> bool:
            return b.key_hashes.get(at)[1] is not None

        await wait_until(b_has_it, 10.0, interval_s=0.02)
        # Whether the watch or the write's answer comes first is etcd's timing: what makes
        # the next check read etcd is that the revocation marks its copy not known.
        forgotten: list[bytes] = []
        forget = b.key_hashes.forget
        b.key_hashes.forget = lambda key: (forgotten.append(key), forget(key))[1]  # type: ignore[method-assign]
    # Revoked here: fails here on the very next check.
    assert await b.revoke_key("k1")
    if isinstance(b, EtcdStore):
        assert forgotten == [b._hash_key("h1")]
    revoked = await b.key_by_hash("h1")
    assert revoked is not None and revoked.revoked_at is not None

    # Revoked at a: fails at b once its copy hears of it.
    assert await a.revoke_key("k2")

    async def revoked_at_b() -> bool:
        key = await b.key_by_hash("h2")
        return key is not None and key.revoked_at is not None

    await wait_until(revoked_at_b, 10.0, interval_s=0.02)
    assert await b.key_by_hash("nope") is None


async def test_concurrent_transitions_of_one_sandbox_exactly_one_wins(
    open_store: OpenStore,
) -> None:
    a, b = open_store(), open_store()
    for round_ in range(10):
        sid = f"i{round_}"
        await a.insert(_record(sid))
        moves = [s.transition(sid, R, SandboxState.KILLING) for s in (a, b) for _ in range(3)]
        results = await asyncio.gather(*moves)
        assert sum(results) == 1, results
    # An update racing a transition never undoes it.
    await a.insert(_record("irace"))
    await asyncio.gather(a.transition("irace", R, P), b.update("irace", end_at=99.0))
    got = await a.get("irace")
    assert got is not None and (got.state, got.end_at) == (P, 99.0)


async def test_claim_takes_over_an_operation_once(open_store: OpenStore) -> None:
    a, b = open_store(), open_store()
    await a.insert(_record("io", state=SandboxState.PAUSING, replica_id="dead"))
    await a.insert(_record("iu", state=SandboxState.KILLING))
    # Of replicas claiming at once, one wins; the row keeps its state and fields.
    claims = [s.claim("io", SandboxState.PAUSING, "dead", name) for s, name in ((a, "a"), (b, "b"))]
    results = await asyncio.gather(*claims)
    assert sorted(results) == [False, True], results
    got = await b.get("io")
    winner = "a" if results[0] else "b"
    assert got is not None and (got.state, got.replica_id) == (SandboxState.PAUSING, winner)
    # A stale owner or state claims nothing; a row no replica stamped is claimed as None.
    assert not await a.claim("io", SandboxState.PAUSING, "dead", "c")
    assert not await a.claim("iu", SandboxState.PAUSING, None, "c")
    assert await a.claim("iu", SandboxState.KILLING, None, "c")
    assert not await b.claim("missing", SandboxState.KILLING, None, "c")
    # A transition carries the stamp like any change.
    assert await a.transition("io", SandboxState.PAUSING, R, replica_id="d")
    got = await a.get("io")
    assert got is not None and (got.state, got.replica_id) == (R, "d")


# -- etcd only -----------------------------------------------------------------------------


@pytest.fixture
async def etcd_pair(
    etcd_cluster: EtcdCluster,
) -> tuple[EtcdStore, EtcdStore]:
    etcd_cluster.ensure_running()
    prefix = f"/agentenv-test-{time.monotonic_ns()}/"
    return (
        EtcdStore(Etcd(etcd_cluster.endpoints, prefix=prefix)),
        EtcdStore(Etcd(etcd_cluster.endpoints, prefix=prefix)),
    )


async def test_etcd_logs_stay_bounded(
    etcd_pair: tuple[EtcdStore, EtcdStore], monkeypatch: pytest.MonkeyPatch
) -> None:
    store, other = etcd_pair
    monkeypatch.setattr(etcd_store, "MAX_LOG_LINES", 10)
    monkeypatch.setattr(etcd_store, "_TRIM_EVERY", 5)
    try:
        for n in range(32):
            await store.log("ia", f"line {n}")
        lines = [ln.message for ln in await store.logs("ia")]
        # Trimmed at the 30th write to the newest 10; two more since.
        assert lines == [f"line {n}" for n in range(20, 32)]
    finally:
        await store.close()
        await other.close()


async def test_etcd_store_calls_carry_on_after_the_leader_is_killed(
    etcd_cluster: EtcdCluster, etcd_pair: tuple[EtcdStore, EtcdStore]
) -> None:
    a, b = etcd_pair
    try:
        killed = False
        stalls: list[float] = []
        for n in range(40):
            sid = f"i{n}"
            started = time.monotonic()
            await a.insert(_record(sid))
            assert await b.transition(sid, R, P)
            await a.log(sid, "paused")
            got = await b.get(sid)
            assert got is not None and got.state is P
            stalls.append(time.monotonic() - started)
            if n == 10:
                etcd_cluster.kill_leader()
                killed = True
        assert killed
        assert len(await a.select([P])) == 40
        print(f"slowest store round with a leader kill: {max(stalls):.2f} s")
        # Etcd's failover rides out the election well inside one call's deadline.
        assert max(stalls) < 6.0
    finally:
        await a.close()
        await b.close()
        etcd_cluster.ensure_running()


async def test_etcd_writes_start_from_the_row_last_seen_and_never_answer_from_it(
    etcd_pair: tuple[EtcdStore, EtcdStore], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A write of a row this replica read or wrote is one transaction, not a read and then
    one. When another replica changed the row since, the stale copy decides nothing: the
    write sees the row as etcd holds it."""
    a, b = etcd_pair
    txns = 0

    def counting(store: EtcdStore) -> None:
        real = store.etcd.txn

        async def txn(*args: Any, **kwargs: Any) -> Any:
            nonlocal txns
            txns += 1
            return await real(*args, **kwargs)

        monkeypatch.setattr(store.etcd, "txn", txn)

    counting(a)
    counting(b)
    try:
        await a.insert(_record("iseen"))
        txns = 0
        assert await a.transition("iseen", R, P)
        assert await a.transition("iseen", P, R, end_at=5.0)
        await a.update("iseen", end_at=6.0)
        assert txns == 3, txns

        got = await b.get("iseen")
        assert got is not None and got.state is R
        assert await a.transition("iseen", R, P)
        # b last saw it running: that does not make b's transition from running succeed,
        # nor one from paused fail.
        assert not await b.transition("iseen", R, SandboxState.KILLING)
        assert await b.transition("iseen", P, R)
        # a's copy is stale now: its update lands on b's row, not over it.
        await a.update("iseen", end_at=9.0)
        got = await b.get("iseen")
        assert got is not None and (got.state, got.end_at) == (R, 9.0)
        assert not await a.claim("iseen", R, "other", "a")
        assert await a.transition("iseen", R, G)
        assert not await b.transition("iseen", R, P)
        got = await b.get("iseen")
        assert got is not None and got.state is G
    finally:
        await a.close()
        await b.close()


async def _until(check: Any, what: str, within_s: float = 2.0) -> None:
    for _ in range(int(within_s * 100)):
        if check():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"not within {within_s} s: {what}")


async def test_etcd_recent_rows_follow_every_replica_and_own_writes_at_once(
    etcd_cluster: EtcdCluster, etcd_pair: tuple[EtcdStore, EtcdStore]
) -> None:
    """A replica that opened its store knows the live rows without reading them: its own
    writes at once, another replica's through its watch, also after the member its watch
    was on died; a row that went is not known."""
    a, b = etcd_pair
    await a.insert(_record("iearly"))
    await b.open()
    try:
        # Rows from before the watch come from its first listing.
        await _until(lambda: b.recent("iearly") is not None, "the listed row")
        await a.insert(_record("iwatch"))
        await _until(lambda: b.recent("iwatch") is not None, "the other replica's insert")
        assert await a.transition("iwatch", R, P)
        await _until(lambda: getattr(b.recent("iwatch"), "state", None) is P, "its pause")
        # Its own write: known as it returns, no waiting on the watch.
        assert await b.transition("iwatch", P, R, end_at=7.0)
        rec = b.recent("iwatch")
        assert rec is not None and (rec.state, rec.end_at) == (R, 7.0)
        assert await a.transition("iwatch", R, G)
        await _until(lambda: b.recent("iwatch") is None, "its deletion")
        assert b.recent("inever") is None
        # The member b's watch streams from dies: the watch goes on from another one.
        watch = b.rows._watch
        assert watch is not None and watch._member is not None
        on = watch._member.endpoint
        etcd_cluster.kill(next(m for m in etcd_cluster.members if m.endpoint == on))
        await a.insert(_record("iafter"))
        await _until(lambda: b.recent("iafter") is not None, "a row after the kill", 20.0)
    finally:
        await b.close()
        await a.close()
        etcd_cluster.ensure_running()
    # Closed, it knows nothing current (the watch is not following any more).
    assert b.recent("iearly") is None
