"""`aenv` client commands against a local-runtime server (no VMs): auth, keys, errors."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from agentenv.api.devserver import ServerProcess

CLI = [sys.executable, "-m", "agentenv.cli.client"]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    srv = ServerProcess(tmp_path_factory.mktemp("cli-local-home"), runtime="local").start()
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture
def env(server: ServerProcess, tmp_path: Path) -> dict[str, str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("E2B_", "AGENTENV_"))}
    # No URL or key in the environment: commands must use what `aenv auth` saved.
    clean.update({"XDG_CONFIG_HOME": str(tmp_path / "config"), "AGENTENV_HOME": str(server.home)})
    return clean


def aenv(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CLI, *args], env=env, capture_output=True, text=True, timeout=120, check=False
    )


def test_auth_keys_and_errors(server: ServerProcess, env: dict[str, str], tmp_path: Path) -> None:
    bad = aenv(env, "auth", "--url", server.url, "--key", "aenv_nope")
    assert bad.returncode == 1 and "invalid API key" in bad.stderr
    ok = aenv(env, "auth", "--url", server.url, "--key", server.api_key)
    assert ok.returncode == 0, ok.stderr
    saved = tmp_path / "config" / "agentenv" / "client.json"
    assert stat.S_IMODE(saved.stat().st_mode) == 0o600
    assert json.loads(saved.read_text())["url"] == server.url

    created = aenv(env, "keys", "create", "ci")
    assert created.returncode == 0, created.stderr
    secret = created.stdout.strip()
    assert secret.startswith("aenv_")
    keys = json.loads(aenv(env, "keys", "ls").stdout)
    ci = next(k for k in keys if k["name"] == "ci")
    assert secret not in json.dumps(keys)

    as_ci = {**env, "E2B_API_KEY": secret}
    assert aenv(as_ci, "ls").returncode == 0
    assert aenv(env, "keys", "revoke", ci["id"]).returncode == 0
    denied = aenv(as_ci, "ls")
    assert denied.returncode == 1 and "invalid API key" in denied.stderr
    again = aenv(env, "keys", "revoke", ci["id"])
    assert again.returncode == 1 and len(again.stderr.strip().splitlines()) == 1

    down = aenv({**env, "AGENTENV_URL": "http://127.0.0.1:9"}, "ls")
    assert down.returncode == 1 and "cannot reach" in down.stderr


def test_exec_streams_and_returns_the_exit_code(env: dict[str, str], server: ServerProcess) -> None:
    assert aenv(env, "auth", "--url", server.url, "--key", server.api_key).returncode == 0
    sid = aenv(env, "start", "-d", "base").stdout.strip()
    try:
        run = aenv(env, "exec", sid, "--", "sh", "-c", "echo a; echo b >&2; exit 4")
        assert (run.returncode, run.stdout, run.stderr) == (4, "a\n", "b\n")
        assert [r["sandboxID"] for r in json.loads(aenv(env, "ls").stdout)] == [sid]
    finally:
        assert aenv(env, "rm", sid).returncode == 0
    assert aenv(env, "exec", sid, "--", "true").returncode == 1
