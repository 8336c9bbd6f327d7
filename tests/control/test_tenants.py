"""Teams in the store (the migration of a store from before teams) and the per-team limits
(`control.tenants`), without a server; all but the migration on both stores (conftest.py)."""

from __future__ import annotations

import asyncio
import sqlite3
import time
from pathlib import Path

import pytest

from agentenv.api.keys import KeyRing, TeamExists, UnknownTeam, hash_key
from agentenv.contract.errors import TooManyRequests
from agentenv.control.etcd_kv import StoreConflict
from agentenv.control.etcd_store import EtcdStore
from agentenv.control.sqlite_store import SqliteStore
from agentenv.control.store import DEFAULT_TEAM, SandboxRecord, SandboxState, Store
from agentenv.control.tenants import SharedPlaces, TeamLimits

from .conftest import OpenStore

# The schema as the last release before teams left it (no team_id anywhere, no teams table).
_OLD_SCHEMA = """
CREATE TABLE sandboxes (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT NOT NULL UNIQUE, template TEXT NOT NULL,
    alias TEXT NOT NULL, state TEXT NOT NULL, started_at REAL NOT NULL, end_at REAL NOT NULL,
    cpu INTEGER NOT NULL, memory_mb INTEGER NOT NULL, disk_mb INTEGER NOT NULL,
    envd_version TEXT NOT NULL, metadata TEXT NOT NULL, env_vars TEXT NOT NULL,
    envd_token TEXT, traffic_token TEXT, auto_pause INTEGER NOT NULL,
    auto_resume INTEGER NOT NULL, allow_internet INTEGER NOT NULL, network TEXT NOT NULL,
    address TEXT, envd_url TEXT, runtime_id TEXT, api_key_id TEXT,
    auto_pause_memory INTEGER NOT NULL DEFAULT 1, pause_mode TEXT
);
CREATE TABLE sandbox_logs (sandbox_id TEXT NOT NULL, ts REAL NOT NULL, level TEXT NOT NULL,
    message TEXT NOT NULL);
CREATE TABLE api_keys (id TEXT PRIMARY KEY, name TEXT NOT NULL, prefix TEXT NOT NULL,
    hash TEXT NOT NULL UNIQUE, created_at REAL NOT NULL, revoked_at REAL);
"""


def _old_store(path: Path, secret: str) -> None:
    db = sqlite3.connect(path)
    db.executescript(_OLD_SCHEMA)
    db.execute(
        "INSERT INTO api_keys VALUES ('kold', 'default', 'e2b_1234', ?, 1.0, NULL)",
        (hash_key(secret),),
    )
    for sid, key in (("iwithkey", "kold"), ("inokey", None)):
        db.execute(
            "INSERT INTO sandboxes (id, template, alias, state, started_at, end_at, cpu, "
            "memory_mb, disk_mb, envd_version, metadata, env_vars, envd_token, auto_pause, "
            "auto_resume, allow_internet, network, api_key_id) VALUES "
            "(?, 'base', 'base', 'paused', 1.0, 2.0, 1, 512, 1024, '0.6.4', '{\"k\":\"v\"}', "
            "'{}', 'tok', 0, 0, 1, '{}', ?)",
            (sid, key),
        )
    db.commit()
    db.close()


async def test_a_store_from_before_teams_is_migrated_in_place(tmp_path: Path) -> None:
    path = tmp_path / "agentenv.db"
    secret = "e2b_" + "ab" * 20
    _old_store(path, secret)
    store = SqliteStore(path)
    try:
        teams = await store.teams()
        assert [(t.id, t.name, t.max_sandboxes, t.creates_per_minute) for t in teams] == [
            (DEFAULT_TEAM, DEFAULT_TEAM, 0, 0)
        ]
        key = await KeyRing(store).verify(secret)
        assert key is not None and key.id == "kold" and key.team_id == DEFAULT_TEAM
        for sid in ("iwithkey", "inokey"):
            rec = await store.get(sid)
            # Nothing lost: the row as it was, now the default team's.
            assert rec is not None and rec.team_id == DEFAULT_TEAM
            assert rec.state is SandboxState.PAUSED and rec.metadata == {"k": "v"}
            assert rec.envd_token == "tok"
        assert {r.id for r in await store.select(team_id=DEFAULT_TEAM)} == {"iwithkey", "inokey"}
        assert await store.select(team_id="tother") == []
    finally:
        await store.close()
    # Opening it again changes nothing (the migration is idempotent).
    again = SqliteStore(path)
    try:
        assert len(await again.teams()) == 1 and await again.get("iwithkey") is not None
    finally:
        await again.close()


async def test_teams_and_their_keys(store: Store, tmp_path: Path) -> None:
    ring = KeyRing(store)
    try:
        team = await ring.create_team("bravo")
        with pytest.raises(TeamExists):
            await ring.create_team("bravo")
        with pytest.raises(UnknownTeam):
            await ring.create("k", "nobody")
        key, secret = await ring.create("k", "bravo")
        assert key.team_id == team.id
        verified = await ring.verify(secret)
        assert verified is not None and verified.team_id == team.id
        # By id or by name.
        assert await ring.team(team.id) == await ring.team("bravo")
        with pytest.raises(ValueError, match="negative"):
            await ring.set_limits("bravo", max_sandboxes=-1)
        updated = await ring.set_limits("bravo", creates_per_minute=5)
        assert (updated.max_sandboxes, updated.creates_per_minute) == (0, 5)
        # The first key of a fresh server is the default team's.
        first = KeyRing(SqliteStore(tmp_path / "fresh"))
        assert await first.ensure_initial(tmp_path / "home") is not None
        assert [k.team_id for k in await first.list()] == [DEFAULT_TEAM]
        await first.store.close()
    finally:
        await store.close()


async def test_of_servers_starting_together_on_an_empty_store_one_makes_the_first_key(
    open_store: OpenStore, tmp_path: Path
) -> None:
    """Replicas started at once on one fresh store (each its own store client): exactly one
    writes a key file, and the store holds exactly that one key."""
    rings = [KeyRing(open_store()) for _ in range(6)]
    homes = [tmp_path / f"home-{i}" for i in range(len(rings))]
    made = await asyncio.gather(*(r.ensure_initial(h) for r, h in zip(rings, homes, strict=True)))
    files = [m for m in made if m is not None]
    assert len(files) == 1, made
    keys = await rings[0].list()
    assert len(keys) == 1 and keys[0].team_id == DEFAULT_TEAM
    assert await rings[1].verify(files[0].read_text().strip()) is not None
    # A later start finds it and makes none.
    assert await KeyRing(open_store()).ensure_initial(tmp_path / "later") is None
    assert len(await rings[0].list()) == 1


async def _running(store: Store, team: str, end_in: float = 300.0) -> None:
    now = time.time()
    await store.insert(
        SandboxRecord(
            id=f"i{now:.6f}".replace(".", ""), template="base", alias="base",
            state=SandboxState.RUNNING, started_at=now, end_at=now + end_in, cpu=1,
            memory_mb=512, disk_mb=1024, envd_version="0.6.4", team_id=team,
        )
    )  # fmt: skip


async def test_concurrency_counts_the_teams_active_sandboxes_and_held_places(
    store: Store,
) -> None:
    try:
        team = await KeyRing(store).create_team("t")
        await store.set_team_limits(team.id, max_sandboxes=2, creates_per_minute=None)
        limits = TeamLimits(store)
        await _running(store, team.id, end_in=7.5)
        await _running(store, DEFAULT_TEAM)  # another team's: not counted
        await limits.admit(team.id)
        async with limits.reserve(team.id):
            with pytest.raises(TooManyRequests) as exc:
                await limits.admit(team.id)
            assert exc.value.status == 429 and exc.value.retry_after == 8
        await limits.admit(team.id, create=False)
        with pytest.raises(TooManyRequests):
            await limits.admit(team.id, 2)
    finally:
        await store.close()


async def test_replicas_sharing_a_store_never_admit_more_than_the_limit_together(
    open_store: OpenStore, request: pytest.FixtureRequest
) -> None:
    """Two replicas (each its own store client and TeamLimits) on one etcd, 10 concurrent
    reserves of a team limited to 3: exactly 3 are admitted, in flight or with rows; a
    replica that dies mid-create (its lease revoked) leaves no place taken."""
    if "sqlite" in request.node.callspec.id:
        pytest.skip("one SQLite file is one server's: nothing is shared across processes")
    a, b = open_store(), open_store()
    assert isinstance(a, SharedPlaces) and isinstance(a, EtcdStore)
    team = await KeyRing(a).create_team("shared")
    await a.set_team_limits(team.id, max_sandboxes=3, creates_per_minute=None)
    lease_a = await a.etcd.grant_lease(300)
    lease_b = await b.etcd.grant_lease(300)  # type: ignore[attr-defined]
    limits = [TeamLimits(a, lease=lambda: lease_a), TeamLimits(b, lease=lambda: lease_b)]
    release = asyncio.Event()
    admitted: list[int] = []

    async def one(i: int) -> None:
        async with limits[i % 2].reserve(team.id):
            admitted.append(i)
            await release.wait()

    async def settled(tasks: list[asyncio.Task[None]], want: int) -> set[asyncio.Task[None]]:
        """Once `want` of them are done (the refused), the rest waiting inside."""
        async with asyncio.timeout(20):
            while sum(t.done() for t in tasks) < want:  # noqa: ASYNC110
                await asyncio.sleep(0.05)
        return {t for t in tasks if t.done()}

    tasks = [asyncio.create_task(one(i)) for i in range(10)]
    done = await settled(tasks, 7)
    refused = [t for t in done if isinstance(t.exception(), TooManyRequests)]
    assert len(admitted) == 3 and len(refused) == 7, (admitted, len(done))
    # The check-only admit sees the other replica's places too.
    with pytest.raises(TooManyRequests):
        await limits[1].admit(team.id)
    release.set()
    await asyncio.gather(*tasks, return_exceptions=True)
    holds, _ = await a.etcd.get_prefix(a.etcd.dir("team-holds"))
    assert holds == []
    # Two rows run now: of six more reserves at once, one fits.
    await _running(a, team.id)
    await _running(b, team.id)
    admitted.clear()
    release.clear()
    tasks = [asyncio.create_task(one(i)) for i in range(6)]
    done = await settled(tasks, 5)
    assert len(admitted) == 1 and len(done) == 5
    # The replica holding that place dies: its lease goes, so does the place.
    holder = lease_a if admitted[0] % 2 == 0 else lease_b
    await a.etcd.revoke_lease(holder)
    survivor = limits[1] if holder == lease_a else limits[0]
    async with survivor.reserve(team.id):
        pass
    release.set()
    await asyncio.gather(*tasks, return_exceptions=True)


async def test_a_hold_the_store_does_not_give_back_fails_nothing_and_goes_later(
    open_store: OpenStore, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The create is done but the store fails to take its hold back (etcd away a moment,
    made here by failing the first two deletes: a real cluster cannot be made to fail just
    those): the create is not failed for it, and the place comes back once the store does."""
    if "sqlite" in request.node.callspec.id:
        pytest.skip("one SQLite file is one server's: nothing is shared across processes")
    store = open_store()
    assert isinstance(store, EtcdStore)
    team = await KeyRing(store).create_team("flaky")
    await store.set_team_limits(team.id, max_sandboxes=1, creates_per_minute=None)
    lease = await store.etcd.grant_lease(300)
    limits = TeamLimits(store, lease=lambda: lease)
    limits.release_retry_s = (1.0, 0.2, 0.2)
    real = store.release_places
    failures = [2]

    async def flaky(team_id: str, hold_id: str) -> None:
        if failures[0] > 0:
            failures[0] -= 1
            raise StoreConflict("etcd is away")
        await real(team_id, hold_id)

    monkeypatch.setattr(store, "release_places", flaky)
    async with limits.reserve(team.id):
        pass  # the create that took the place is done
    with pytest.raises(TooManyRequests):  # its hold is still there
        await limits.admit(team.id)
    async with asyncio.timeout(5):
        while (await store.etcd.get_prefix(store.etcd.dir("team-holds")))[0]:  # noqa: ASYNC110
            await asyncio.sleep(0.05)
    async with limits.reserve(team.id):
        pass
    await limits.close()


async def test_the_create_rate_is_a_token_bucket(store: Store) -> None:
    try:
        team = await KeyRing(store).create_team("t")
        await store.set_team_limits(team.id, max_sandboxes=None, creates_per_minute=6)
        now = [0.0]
        limits = TeamLimits(store, clock=lambda: now[0])
        for _ in range(6):  # a minute's allowance as one burst
            await limits.admit(team.id)
        with pytest.raises(TooManyRequests) as exc:
            await limits.admit(team.id)
        assert exc.value.retry_after == 10
        # Resumes take no token.
        await limits.admit(team.id, create=False)
        now[0] = 10.0
        await limits.admit(team.id)
        with pytest.raises(TooManyRequests):
            await limits.admit(team.id)
        # Never more than one minute's worth saved up.
        now[0] = 1000.0
        with pytest.raises(TooManyRequests) as exc:
            await limits.admit(team.id, 7)
        assert exc.value.retry_after == 60
        await limits.admit(team.id, 6)
        # No limit: always admitted.
        await store.set_team_limits(team.id, max_sandboxes=None, creates_per_minute=0)
        for _ in range(100):
            await limits.admit(team.id)
    finally:
        await store.close()
