"""`SqliteStore`: the control plane's `Store` in one SQLite file per server, the single-node
default (`control.backend` picks it when no etcd is configured).

Every state change is a compare-and-set ``UPDATE … WHERE state = ?`` so two writers can never
both win a transition. Its statements run inline in the async methods: each touches one
indexed row in a local WAL database and returns in well under a millisecond, cheaper than a
thread hop, and an async method without an await inside never yields, so on one event loop a
read-then-write sequence of them is as atomic as it was when they were synchronous.
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from agentenv.control.sqlite_checkpoint import WalCheckpointer
from agentenv.control.store import (
    ACTIVE_STATES,
    BUILD_METADATA,
    DEFAULT_TEAM,
    LIVE_STATES,
    ApiKey,
    LogLine,
    SandboxRecord,
    SandboxState,
    Team,
)

# SQL: the row is not a build sandbox.
_NOT_BUILD = f"json_extract(metadata, '$.\"{BUILD_METADATA}\"') IS NULL"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS sandboxes (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT NOT NULL UNIQUE,
    template TEXT NOT NULL,
    alias TEXT NOT NULL,
    state TEXT NOT NULL,
    started_at REAL NOT NULL,
    end_at REAL NOT NULL,
    cpu INTEGER NOT NULL,
    memory_mb INTEGER NOT NULL,
    disk_mb INTEGER NOT NULL,
    envd_version TEXT NOT NULL,
    metadata TEXT NOT NULL,
    env_vars TEXT NOT NULL,
    envd_token TEXT,
    traffic_token TEXT,
    auto_pause INTEGER NOT NULL,
    auto_resume INTEGER NOT NULL,
    allow_internet INTEGER NOT NULL,
    network TEXT NOT NULL,
    address TEXT,
    envd_url TEXT,
    api_key_id TEXT,
    auto_pause_memory INTEGER NOT NULL DEFAULT 1,
    pause_mode TEXT
);
CREATE INDEX IF NOT EXISTS sandboxes_state ON sandboxes(state, end_at);
CREATE TABLE IF NOT EXISTS sandbox_logs (
    sandbox_id TEXT NOT NULL,
    ts REAL NOT NULL,
    level TEXT NOT NULL,
    message TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS sandbox_logs_id ON sandbox_logs(sandbox_id, ts);
CREATE TABLE IF NOT EXISTS api_keys (
    id TEXT PRIMARY KEY,
    name TEXT NOT NULL,
    prefix TEXT NOT NULL,
    hash TEXT NOT NULL UNIQUE,
    created_at REAL NOT NULL,
    revoked_at REAL
);
CREATE TABLE IF NOT EXISTS teams (
    id TEXT PRIMARY KEY,
    name TEXT NOT NULL UNIQUE,
    created_at REAL NOT NULL,
    max_sandboxes INTEGER NOT NULL DEFAULT 0,
    creates_per_minute INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS snapshot_owners (
    snapshot_id TEXT PRIMARY KEY,
    team_id TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS idempotency (
    api_key_id TEXT NOT NULL,
    key TEXT NOT NULL,
    body_hash TEXT NOT NULL,
    sandbox_id TEXT,
    created_at REAL NOT NULL,
    PRIMARY KEY (api_key_id, key)
);
"""

_COLUMNS = (
    "id", "template", "alias", "state", "started_at", "end_at", "cpu", "memory_mb", "disk_mb",
    "envd_version", "metadata", "env_vars", "envd_token", "traffic_token", "auto_pause",
    "auto_resume", "allow_internet", "network", "address", "envd_url", "api_key_id",
    "auto_pause_memory", "pause_mode", "team_id", "replica_id", "node_id", "grace_s",
    "keepalive_s", "seen_at", "grace_until", "reset_to", "origin",
)  # fmt: skip
# Columns added after the first schema: (table, name, declaration), added to older databases.
_ADDED_COLUMNS = (
    ("sandboxes", "auto_pause_memory", "INTEGER NOT NULL DEFAULT 1"),
    ("sandboxes", "pause_mode", "TEXT"),
    ("sandboxes", "team_id", "TEXT"),
    ("sandboxes", "replica_id", "TEXT"),
    ("sandboxes", "node_id", "TEXT"),
    ("sandboxes", "grace_s", "INTEGER NOT NULL DEFAULT 0"),
    ("sandboxes", "keepalive_s", "INTEGER NOT NULL DEFAULT 0"),
    ("sandboxes", "seen_at", "REAL NOT NULL DEFAULT 0"),
    ("sandboxes", "grace_until", "REAL NOT NULL DEFAULT 0"),
    ("sandboxes", "reset_to", "TEXT"),
    ("sandboxes", "origin", "TEXT"),
    ("api_keys", "team_id", "TEXT"),
)
_KEY_COLUMNS = "id, name, prefix, created_at, revoked_at, team_id"
_TEAM_COLUMNS = "id, name, created_at, max_sandboxes, creates_per_minute"


class SqliteStore:
    """One SQLite database file; a single connection owned by the server's event loop."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        self._db.row_factory = sqlite3.Row
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute("PRAGMA busy_timeout=5000")
        # Checkpoints fsync: `checkpoints` makes them on a thread of its own, not a commit.
        self._db.execute("PRAGMA wal_autocheckpoint=0")
        self.checkpoints = WalCheckpointer(path, changes=lambda: self._db.total_changes)
        self._db.executescript(_SCHEMA)
        self._migrate()

    def _migrate(self) -> None:
        """Bring an older database up to this schema in place. Teams came late: every key
        and sandbox from before them goes to the default team (created here, always
        present), so a store from a single-user server keeps working unchanged."""
        for table, name, decl in _ADDED_COLUMNS:
            have = {row[1] for row in self._db.execute(f"PRAGMA table_info({table})")}
            if name not in have:
                self._db.execute(f"ALTER TABLE {table} ADD COLUMN {name} {decl}")
        self._db.execute(
            "INSERT OR IGNORE INTO teams (id, name, created_at) VALUES (?, ?, ?)",
            (DEFAULT_TEAM, DEFAULT_TEAM, time.time()),
        )
        self._db.execute("UPDATE api_keys SET team_id = ? WHERE team_id IS NULL", (DEFAULT_TEAM,))
        # A sandbox is its creating key's team's; rows without a key (made in process, by
        # tests or the builder of old) are the default team's.
        self._db.execute(
            "UPDATE sandboxes SET team_id = COALESCE((SELECT k.team_id FROM api_keys k "
            "WHERE k.id = sandboxes.api_key_id), ?) WHERE team_id IS NULL",
            (DEFAULT_TEAM,),
        )
        self._db.execute("CREATE INDEX IF NOT EXISTS sandboxes_team ON sandboxes(team_id, state)")
        # Columns a later schema folded away: the node's own id of a sandbox went when the
        # node came to run every sandbox under the control plane's id. A live row of an
        # older server whose node id differed is found lost by the next start's recovery.
        columns = [row[1] for row in self._db.execute("PRAGMA table_info(sandboxes)")]
        for name in columns:
            if name != "seq" and name not in _COLUMNS:
                self._db.execute(f"ALTER TABLE sandboxes DROP COLUMN {name}")

    async def open(self) -> None:
        self.checkpoints.start()

    async def close(self) -> None:
        await self.checkpoints.close()
        self._db.close()

    @contextlib.contextmanager
    def _one_commit(self, needed: bool = True) -> Iterator[None]:
        """The statements inside as one transaction: one commit (the connection otherwise
        commits each statement on its own). Not `needed` (one statement): as it is."""
        if not needed:
            yield
            return
        self._db.execute("BEGIN")
        try:
            yield
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")

    # -- sandboxes -------------------------------------------------------------------------

    async def insert(self, rec: SandboxRecord, *, note: str | None = None) -> None:
        row = _to_row(rec)
        marks = ",".join("?" for _ in _COLUMNS)
        with self._one_commit(note is not None):
            cur = self._db.execute(
                f"INSERT INTO sandboxes ({','.join(_COLUMNS)}) VALUES ({marks})",
                [row[c] for c in _COLUMNS],
            )
            if note is not None:
                self._log(rec.id, note, "info")
        rec.seq = int(cur.lastrowid or 0)

    async def get(self, sandbox_id: str) -> SandboxRecord | None:
        row = self._db.execute("SELECT * FROM sandboxes WHERE id = ?", (sandbox_id,)).fetchone()
        return _from_row(row) if row else None

    def recent(self, sandbox_id: str) -> SandboxRecord | None:
        # The file is this server's alone and `get` is a local read: no view is kept.
        return None

    async def transition(
        self,
        sandbox_id: str,
        expected: SandboxState | Iterable[SandboxState],
        new: SandboxState,
        *,
        note: str | None = None,
        **changes: Any,
    ) -> bool:
        """Move a sandbox to ``new`` only if it is in ``expected``; returns whether it moved."""
        states = [expected] if isinstance(expected, SandboxState) else list(expected)
        sets = ["state = ?"]
        args: list[Any] = [new.value]
        for key, value in changes.items():
            sets.append(f"{key} = ?")
            args.append(_encode(key, value))
        marks = ",".join("?" for _ in states)
        with self._one_commit(note is not None):
            cur = self._db.execute(
                f"UPDATE sandboxes SET {', '.join(sets)} WHERE id = ? AND state IN ({marks})",
                [*args, sandbox_id, *(s.value for s in states)],
            )
            moved = cur.rowcount == 1
            if moved and note is not None:
                self._log(sandbox_id, note, "info")
        return moved

    async def claim(
        self, sandbox_id: str, state: SandboxState, was: str | None, replica_id: str
    ) -> bool:
        cur = self._db.execute(
            "UPDATE sandboxes SET replica_id = ? WHERE id = ? AND state = ? AND replica_id IS ?",
            (replica_id, sandbox_id, state.value, was),
        )
        return cur.rowcount == 1

    async def update(self, sandbox_id: str, **changes: Any) -> None:
        sets = [f"{key} = ?" for key in changes]
        args = [_encode(k, v) for k, v in changes.items()]
        self._db.execute(
            f"UPDATE sandboxes SET {', '.join(sets)} WHERE id = ?", [*args, sandbox_id]
        )

    async def select(
        self,
        states: Iterable[SandboxState] | None = None,
        *,
        after_seq: int = 0,
        descending: bool = False,
        before_seq: int | None = None,
        team_id: str | None = None,
    ) -> list[SandboxRecord]:
        where = ["1 = 1"]
        args: list[Any] = []
        if team_id is not None:
            where.append("team_id = ?")
            args.append(team_id)
        if states is not None:
            vals = [s.value for s in states]
            where.append(f"state IN ({','.join('?' for _ in vals)})")
            args.extend(vals)
        if after_seq:
            where.append("seq > ?")
            args.append(after_seq)
        if before_seq is not None:
            where.append("seq < ?")
            args.append(before_seq)
        order = "DESC" if descending else "ASC"
        rows = self._db.execute(
            f"SELECT * FROM sandboxes WHERE {' AND '.join(where)} ORDER BY seq {order}", args
        ).fetchall()
        return [_from_row(r) for r in rows]

    async def envd_tokens(self) -> list[tuple[str, str]]:
        """(id, envd access token) of every live sandbox that has a token; two columns only,
        so the proxy can match a signed URL against all of them cheaply (`proxy.signed`)."""
        marks = ",".join("?" for _ in LIVE_STATES)
        rows = self._db.execute(
            f"SELECT id, envd_token FROM sandboxes WHERE envd_token IS NOT NULL "
            f"AND state IN ({marks})",
            [s.value for s in LIVE_STATES],
        ).fetchall()
        return [(str(r[0]), str(r[1])) for r in rows]

    async def expired(self, now: float) -> list[SandboxRecord]:
        rows = self._db.execute(
            "SELECT * FROM sandboxes WHERE state = ? AND end_at <= ?",
            (SandboxState.RUNNING.value, now),
        ).fetchall()
        return [_from_row(r) for r in rows]

    async def next_deadline(self) -> float | None:
        row = self._db.execute(
            "SELECT MIN(end_at) FROM sandboxes WHERE state = ?", (SandboxState.RUNNING.value,)
        ).fetchone()
        return float(row[0]) if row and row[0] is not None else None

    async def count_by_state(self) -> dict[str, int]:
        """Users' sandboxes by state (template build sandboxes are `count_builds`)."""
        rows = self._db.execute(
            f"SELECT state, COUNT(*) FROM sandboxes WHERE {_NOT_BUILD} GROUP BY state"
        ).fetchall()
        return {str(r[0]): int(r[1]) for r in rows}

    async def count_active(self, team_id: str) -> tuple[int, float | None]:
        """The team's users' sandboxes that hold a VM or are about to (`ACTIVE_STATES`),
        and the soonest timeout among them (None if none has one)."""
        marks = ",".join("?" for _ in ACTIVE_STATES)
        row = self._db.execute(
            f"SELECT COUNT(*), MIN(end_at) FROM sandboxes WHERE team_id = ? AND {_NOT_BUILD} "
            f"AND state IN ({marks})",
            [team_id, *(s.value for s in ACTIVE_STATES)],
        ).fetchone()
        return int(row[0]), (float(row[1]) if row[1] is not None else None)

    async def count_builds(self) -> int:
        """Template build sandboxes that still hold (or are about to hold) a VM."""
        marks = ",".join("?" for _ in LIVE_STATES)
        row = self._db.execute(
            f"SELECT COUNT(*) FROM sandboxes WHERE NOT ({_NOT_BUILD}) AND state IN ({marks})",
            [s.value for s in LIVE_STATES],
        ).fetchone()
        return int(row[0])

    async def spawns(self, team_id: str | None = None) -> dict[str, tuple[int, float]]:
        """templateID → (sandboxes that started from it, when the last one did), build
        sandboxes and failed creates not counted: E2B's spawnCount and lastSpawnedAt. Rows
        are never deleted, so this is the whole history of this data dir. `team_id`: only
        that team's sandboxes (a public template's count is each team's own)."""
        team_sql, args = ("AND team_id = ? ", [team_id]) if team_id is not None else ("", [])
        rows = self._db.execute(
            f"SELECT template, COUNT(*), MAX(started_at) FROM sandboxes WHERE {_NOT_BUILD} "
            f"AND envd_url IS NOT NULL {team_sql}GROUP BY template",
            args,
        ).fetchall()
        return {str(r[0]): (int(r[1]), float(r[2])) for r in rows}

    # -- logs ------------------------------------------------------------------------------

    async def log(self, sandbox_id: str, message: str, level: str = "info") -> None:
        self._log(sandbox_id, message, level)

    def _log(self, sandbox_id: str, message: str, level: str) -> None:
        self._db.execute(
            "INSERT INTO sandbox_logs (sandbox_id, ts, level, message) VALUES (?, ?, ?, ?)",
            (sandbox_id, time.time(), level, message),
        )

    async def logs(
        self, sandbox_id: str, *, start: float = 0.0, limit: int = 1000
    ) -> list[LogLine]:
        rows = self._db.execute(
            "SELECT sandbox_id, ts, level, message FROM sandbox_logs "
            "WHERE sandbox_id = ? AND ts >= ? ORDER BY ts, rowid LIMIT ?",
            (sandbox_id, start, limit),
        ).fetchall()
        return [LogLine(r[0], r[1], r[2], r[3]) for r in rows]

    # -- teams -----------------------------------------------------------------------------

    async def add_team(self, team_id: str, name: str) -> Team:
        now = time.time()
        self._db.execute(
            "INSERT INTO teams (id, name, created_at) VALUES (?, ?, ?)", (team_id, name, now)
        )
        return Team(team_id, name, now)

    async def team(self, ref: str) -> Team | None:
        """A team by id or by name."""
        row = self._db.execute(
            f"SELECT {_TEAM_COLUMNS} FROM teams WHERE id = ? OR name = ? ORDER BY id = ? DESC",
            (ref, ref, ref),
        ).fetchone()
        return Team(*row) if row else None

    async def teams(self) -> list[Team]:
        rows = self._db.execute(f"SELECT {_TEAM_COLUMNS} FROM teams ORDER BY created_at").fetchall()
        return [Team(*r) for r in rows]

    async def set_team_limits(
        self, team_id: str, *, max_sandboxes: int | None, creates_per_minute: int | None
    ) -> bool:
        sets: list[str] = []
        args: list[Any] = []
        if max_sandboxes is not None:
            sets.append("max_sandboxes = ?")
            args.append(max_sandboxes)
        if creates_per_minute is not None:
            sets.append("creates_per_minute = ?")
            args.append(creates_per_minute)
        if not sets:
            return await self.team(team_id) is not None
        cur = self._db.execute(f"UPDATE teams SET {', '.join(sets)} WHERE id = ?", [*args, team_id])
        return cur.rowcount == 1

    # -- snapshot owners ---------------------------------------------------------------------

    async def set_snapshot_owner(self, snapshot_id: str, team_id: str) -> None:
        self._db.execute(
            "INSERT OR REPLACE INTO snapshot_owners (snapshot_id, team_id) VALUES (?, ?)",
            (snapshot_id, team_id),
        )

    async def snapshot_owner(self, snapshot_id: str) -> str:
        """The team a snapshot belongs to; one made before teams existed is the default
        team's."""
        row = self._db.execute(
            "SELECT team_id FROM snapshot_owners WHERE snapshot_id = ?", (snapshot_id,)
        ).fetchone()
        return str(row[0]) if row else DEFAULT_TEAM

    # -- API keys --------------------------------------------------------------------------

    async def add_key(
        self, key_id: str, name: str, prefix: str, key_hash: str, team_id: str = DEFAULT_TEAM
    ) -> ApiKey:
        now = time.time()
        self._db.execute(
            "INSERT INTO api_keys (id, name, prefix, hash, created_at, team_id) "
            "VALUES (?, ?, ?, ?, ?, ?)",
            (key_id, name, prefix, key_hash, now, team_id),
        )
        return ApiKey(key_id, name, prefix, now, None, team_id)

    async def add_first_key(
        self, key_id: str, name: str, prefix: str, key_hash: str, team_id: str = DEFAULT_TEAM
    ) -> ApiKey | None:
        now = time.time()
        cur = self._db.execute(
            "INSERT INTO api_keys (id, name, prefix, hash, created_at, team_id) "
            "SELECT ?, ?, ?, ?, ?, ? WHERE NOT EXISTS (SELECT 1 FROM api_keys)",
            (key_id, name, prefix, key_hash, now, team_id),
        )
        return ApiKey(key_id, name, prefix, now, None, team_id) if cur.rowcount == 1 else None

    async def key_by_hash(self, key_hash: str) -> ApiKey | None:
        row = self._db.execute(
            f"SELECT {_KEY_COLUMNS} FROM api_keys WHERE hash = ?", (key_hash,)
        ).fetchone()
        return ApiKey(*row) if row else None

    async def key(self, key_id: str) -> ApiKey | None:
        row = self._db.execute(
            f"SELECT {_KEY_COLUMNS} FROM api_keys WHERE id = ?", (key_id,)
        ).fetchone()
        return ApiKey(*row) if row else None

    async def keys(self) -> list[ApiKey]:
        rows = self._db.execute(
            f"SELECT {_KEY_COLUMNS} FROM api_keys ORDER BY created_at"
        ).fetchall()
        return [ApiKey(*r) for r in rows]

    async def revoke_key(self, key_id: str) -> bool:
        cur = self._db.execute(
            "UPDATE api_keys SET revoked_at = ? WHERE id = ? AND revoked_at IS NULL",
            (time.time(), key_id),
        )
        return cur.rowcount == 1

    # -- idempotency -----------------------------------------------------------------------

    async def claim_idempotency(self, api_key_id: str, key: str, body_hash: str) -> bool:
        """Reserve ``key``; False if it was already taken."""
        cur = self._db.execute(
            "INSERT OR IGNORE INTO idempotency (api_key_id, key, body_hash, created_at) "
            "VALUES (?, ?, ?, ?)",
            (api_key_id, key, body_hash, time.time()),
        )
        return cur.rowcount == 1

    async def idempotency(self, api_key_id: str, key: str) -> tuple[str, str | None] | None:
        row = self._db.execute(
            "SELECT body_hash, sandbox_id FROM idempotency WHERE api_key_id = ? AND key = ?",
            (api_key_id, key),
        ).fetchone()
        return (str(row[0]), row[1]) if row else None

    async def complete_idempotency(self, api_key_id: str, key: str, sandbox_id: str) -> None:
        self._db.execute(
            "UPDATE idempotency SET sandbox_id = ? WHERE api_key_id = ? AND key = ?",
            (sandbox_id, api_key_id, key),
        )

    async def release_idempotency(self, api_key_id: str, key: str) -> None:
        self._db.execute(
            "DELETE FROM idempotency WHERE api_key_id = ? AND key = ? AND sandbox_id IS NULL",
            (api_key_id, key),
        )

    async def expire_idempotency(self, older_than: float) -> None:
        self._db.execute("DELETE FROM idempotency WHERE created_at < ?", (older_than,))


_JSON_COLUMNS = {"metadata", "env_vars", "network"}
_BOOL_COLUMNS = {"auto_pause", "auto_resume", "allow_internet", "auto_pause_memory"}


def _encode(key: str, value: Any) -> Any:
    if key in _JSON_COLUMNS:
        return json.dumps(value, separators=(",", ":"))
    if key in _BOOL_COLUMNS:
        return int(bool(value))
    if isinstance(value, SandboxState):
        return value.value
    return value


def _to_row(rec: SandboxRecord) -> dict[str, Any]:
    return {c: _encode(c, getattr(rec, c)) for c in _COLUMNS}


def _from_row(row: sqlite3.Row) -> SandboxRecord:
    return SandboxRecord(
        id=row["id"],
        template=row["template"],
        alias=row["alias"],
        state=SandboxState(row["state"]),
        started_at=row["started_at"],
        end_at=row["end_at"],
        cpu=row["cpu"],
        memory_mb=row["memory_mb"],
        disk_mb=row["disk_mb"],
        envd_version=row["envd_version"],
        metadata=json.loads(row["metadata"]),
        env_vars=json.loads(row["env_vars"]),
        envd_token=row["envd_token"],
        traffic_token=row["traffic_token"],
        auto_pause=bool(row["auto_pause"]),
        auto_resume=bool(row["auto_resume"]),
        allow_internet=bool(row["allow_internet"]),
        network=json.loads(row["network"]),
        address=row["address"],
        envd_url=row["envd_url"],
        api_key_id=row["api_key_id"],
        team_id=row["team_id"] or DEFAULT_TEAM,
        auto_pause_memory=bool(row["auto_pause_memory"]),
        pause_mode=row["pause_mode"],
        replica_id=row["replica_id"],
        node_id=row["node_id"],
        grace_s=row["grace_s"],
        keepalive_s=row["keepalive_s"],
        seen_at=row["seen_at"],
        grace_until=row["grace_until"],
        reset_to=row["reset_to"],
        origin=row["origin"],
        seq=row["seq"],
    )
