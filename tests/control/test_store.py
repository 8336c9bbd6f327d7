"""The SQLite store: columns added after the first schema reach databases made before them."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from agentenv.control.store import SandboxRecord, SandboxState, Store

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


def test_an_older_database_gets_the_new_columns(tmp_path: Path) -> None:
    db = tmp_path / "agentenv.db"
    with sqlite3.connect(db) as conn:
        conn.executescript(_OLD_TABLE)
    store = Store(db)
    old = store.get("iold")
    # A row from before: its auto-pause kept memory, its pause mode is unknown.
    assert old is not None and old.auto_pause_memory is True and old.pause_mode is None
    store.insert(_record("inew", auto_pause_memory=False))
    assert store.transition(
        "inew", SandboxState.RUNNING, SandboxState.PAUSED, pause_mode="filesystem"
    )
    new = store.get("inew")
    assert new is not None
    assert (new.auto_pause_memory, new.pause_mode) == (False, "filesystem")
    store.close()
    # Opening it again adds nothing twice.
    again = Store(db)
    assert again.get("inew") == new
    again.close()
