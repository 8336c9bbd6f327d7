"""`aenv setup` is idempotent: a second run on the same inputs rebuilds nothing."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from agentenv.config import Settings

AENV = [sys.executable, "-m", "agentenv.cli"]


def _tree_state(root: Path) -> dict[str, int]:
    """Every published file under `root` with its modification time: a rebuild changes one or
    adds one. Dot-directories are builds in progress (another process may be running one)."""
    state = {}
    for p in root.rglob("*"):
        rel = p.relative_to(root)
        if p.is_file() and not any(part.startswith(".") for part in rel.parts):
            state[str(rel)] = p.stat().st_mtime_ns
    return state


def _setup(home: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, AGENTENV_HOME=str(home))
    return subprocess.run(
        [*AENV, "setup", "--skip-packages"],
        env=env,
        capture_output=True,
        text=True,
        timeout=3600,
        check=False,
    )


def test_second_setup_is_a_cache_hit(tmp_path: Path) -> None:
    home = tmp_path / "home"
    first = _setup(home)
    assert first.returncode == 0, first.stderr
    cache = Settings.from_env().cache
    cache_before = _tree_state(cache)
    home_before = _tree_state(home)

    second = _setup(home)
    assert second.returncode == 0, second.stderr
    assert "template base" in second.stderr
    assert _tree_state(cache) == cache_before
    assert _tree_state(home) == home_before


def test_setup_rejects_a_bad_setting(tmp_path: Path) -> None:
    env = dict(os.environ, AGENTENV_HOME=str(tmp_path), AGENTENV_SLOT_CIDR="10.0.0.0/8x")
    proc = subprocess.run(
        [*AENV, "setup", "--skip-packages"], env=env, capture_output=True, text=True, check=False
    )
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "AGENTENV_SLOT_CIDR" in lines[0], proc.stderr
