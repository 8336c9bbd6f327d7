"""`aenv keys` and `aenv teams` on a server's database (no server running): each command as
a child process, as an operator runs it; every refusal is one line and a non-zero exit."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

from agentenv.api.keys import KeyRing
from agentenv.control.sqlite_store import SqliteStore

AENV = [sys.executable, "-m", "agentenv.cli"]


def _aenv(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("E2B_", "AGENTENV_"))}
    env["AGENTENV_HOME"] = str(home)
    return subprocess.run(
        [*AENV, *args], env=env, capture_output=True, text=True, timeout=60, check=False
    )


def test_teams_keys_and_limits(tmp_path: Path) -> None:
    home = tmp_path / "home"
    # Before any server ran: one line, non-zero.
    r = _aenv(home, "teams", "ls")
    assert r.returncode != 0 and "aenv serve" in r.stderr and len(r.stderr.splitlines()) == 1
    asyncio.run(SqliteStore(home / "agentenv.db").close())
    r = _aenv(home, "teams", "create", "bravo")
    assert r.returncode == 0, r.stderr
    r = _aenv(home, "teams", "create", "bravo")
    assert r.returncode == 1 and "exists already" in r.stderr
    r = _aenv(home, "keys", "create", "bob", "--team", "bravo")
    assert r.returncode == 0, r.stderr
    secret = r.stdout.strip()
    assert secret.startswith("e2b_") and len(secret) == 44
    r = _aenv(home, "keys", "create", "x", "--team", "nobody")
    assert r.returncode == 1 and "no team" in r.stderr and not r.stdout
    # Not a terminal: JSON rows.
    keys = json.loads(_aenv(home, "keys", "ls").stdout)
    assert [(k["name"], k["team"], k["revoked"]) for k in keys] == [("bob", "bravo", "")]
    r = _aenv(home, "teams", "set-limits", "bravo", "--max-sandboxes", "3")
    assert r.returncode == 0 and "max sandboxes 3" in r.stderr, r.stderr
    r = _aenv(home, "teams", "set-limits", "bravo", "--creates-per-minute", "-1")
    assert r.returncode == 1 and "negative" in r.stderr
    r = _aenv(home, "teams", "set-limits", "bravo")
    assert r.returncode == 1
    teams = {t["name"]: t for t in json.loads(_aenv(home, "teams", "ls").stdout)}
    assert teams["bravo"]["max_sandboxes"] == "3"
    assert teams["bravo"]["creates_per_minute"] == "none"
    assert set(teams) == {"default", "bravo"}
    store = SqliteStore(home / "agentenv.db")
    try:
        ring = KeyRing(store)
        assert asyncio.run(ring.verify(secret)) is not None
        r = _aenv(home, "keys", "revoke", keys[0]["id"])
        assert r.returncode == 0, r.stderr
        assert asyncio.run(ring.verify(secret)) is None
        r = _aenv(home, "keys", "revoke", keys[0]["id"])
        assert r.returncode == 1 and "no active API key" in r.stderr
    finally:
        asyncio.run(store.close())
