"""The `aenv` client commands against a server whose sandboxes are real microVMs: auth, keys and
errors, detached start/exec/pause/resume/rm, and the interactive shell, driven through tmux like
a person at a terminal."""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from agentenv.api.devserver import ServerProcess
from agentenv.template.datadir import prepare_home

pytestmark = pytest.mark.vm

CLI = [sys.executable, "-m", "agentenv.cli.client"]


@pytest.fixture(scope="module")
def vm_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    home = prepare_home(tmp_path_factory.mktemp("cli-home"))
    srv = ServerProcess(home, ready_timeout_s=180).start()
    try:
        yield srv
    finally:
        srv.stop(timeout_s=120)


@pytest.fixture
def cli_env(vm_server: ServerProcess, tmp_path: object) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("E2B_")}
    env.update(
        {
            "AGENTENV_URL": vm_server.url,
            "AGENTENV_API_KEY": vm_server.api_key,
            "XDG_CONFIG_HOME": str(tmp_path),
        }
    )
    return env


@pytest.fixture
def saved_auth_env(vm_server: ServerProcess, tmp_path: Path) -> dict[str, str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("E2B_", "AGENTENV_"))}
    # No URL or key in the environment: commands must use what `aenv auth` saved.
    clean.update(
        {"XDG_CONFIG_HOME": str(tmp_path / "config"), "AGENTENV_HOME": str(vm_server.home)}
    )
    return clean


def aenv(env: dict[str, str], *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CLI, *args], env=env, capture_output=True, text=True, timeout=timeout, check=False
    )


def test_auth_keys_and_errors(
    vm_server: ServerProcess, saved_auth_env: dict[str, str], tmp_path: Path
) -> None:
    env = saved_auth_env
    bad = aenv(env, "auth", "--url", vm_server.url, "--key", "aenv_nope")
    assert bad.returncode == 1 and "invalid API key" in bad.stderr
    ok = aenv(env, "auth", "--url", vm_server.url, "--key", vm_server.api_key)
    assert ok.returncode == 0, ok.stderr
    saved = tmp_path / "config" / "agentenv" / "client.json"
    assert stat.S_IMODE(saved.stat().st_mode) == 0o600
    assert json.loads(saved.read_text())["url"] == vm_server.url
    assert aenv(env, "ls").returncode == 0

    created = aenv(env, "keys", "create", "ci")
    assert created.returncode == 0, created.stderr
    secret = created.stdout.strip()
    # E2B's format, which the JS SDK (2.27+) checks before sending anything.
    assert re.fullmatch(r"e2b_[0-9a-f]{40}", secret), secret
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


def _pane(session: str) -> str:
    res = subprocess.run(
        ["tmux", "capture-pane", "-p", "-t", session, "-S", "-200"],
        capture_output=True,
        text=True,
        check=False,
    )
    if res.returncode != 0:
        raise AssertionError(f"tmux session {session} is gone: {res.stderr.strip()}")
    return res.stdout


def _wait_for(session: str, needle: str, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    text = ""
    while time.monotonic() < deadline:
        text = _pane(session)
        if needle in text:
            return text
        time.sleep(0.3)
    raise AssertionError(f"{needle!r} never appeared; screen:\n{text}")


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")
def test_start_gives_an_interactive_shell(
    vm_server: ServerProcess, cli_env: dict[str, str]
) -> None:
    session = f"aenv-{uuid.uuid4().hex[:8]}"
    env_args = [f"{k}={v}" for k, v in cli_env.items() if k.startswith(("AGENTENV", "XDG"))]
    command = " ".join([*CLI, "start", "base"]) + "; echo EXITED=$?; sleep 120"
    subprocess.run(
        ["tmux", "new-session", "-d", "-s", session, "-x", "120", "-y", "30",
         "env", *env_args, "sh", "-c", command],
        check=True,
    )  # fmt: skip
    try:
        screen = _wait_for(session, "exit the shell to kill it", 240)
        sandbox_id = screen.split("sandbox ", 1)[1].split()[0]
        _wait_for(session, "user@", 120)
        subprocess.run(
            ["tmux", "send-keys", "-t", session, "echo hi-$((40+2))", "Enter"], check=True
        )
        _wait_for(session, "hi-42", 60)
        # The sandbox's PTY has the size of the terminal the CLI runs in.
        pane = subprocess.run(
            ["tmux", "display-message", "-p", "-t", session, "#{pane_height} #{pane_width}"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        subprocess.run(["tmux", "send-keys", "-t", session, "stty size", "Enter"], check=True)
        _wait_for(session, f"\n{pane}", 60)
        subprocess.run(["tmux", "send-keys", "-t", session, "exit 5", "Enter"], check=True)
        _wait_for(session, "EXITED=5", 60)
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], check=False)
    # Leaving the shell killed the sandbox.
    with httpx.Client(base_url=vm_server.url, headers={"X-API-Key": vm_server.api_key}) as c:
        assert c.get(f"/sandboxes/{sandbox_id}").status_code == 404


def test_detached_start_exec_ls_and_rm(vm_server: ServerProcess, cli_env: dict[str, str]) -> None:
    started = aenv(cli_env, "start", "-d", "base", "-m", "who=cli", "-e", "GREETING=hey")
    assert started.returncode == 0, started.stderr
    sid = started.stdout.strip()
    try:
        run = aenv(cli_env, "exec", sid, "--", "sh", "-c", "echo $GREETING; echo oops >&2; exit 3")
        assert run.returncode == 3
        assert run.stdout == "hey\n" and run.stderr == "oops\n"

        listed = aenv(cli_env, "ls", "-m", "who=cli")
        assert listed.returncode == 0
        rows = json.loads(listed.stdout)  # piped: JSON, not a table
        assert [r["sandboxID"] for r in rows] == [sid]

        assert aenv(cli_env, "timeout", sid, "120").returncode == 0
        # Pause and resume keep the guest as it was (/tmp is in its memory).
        marked = aenv(cli_env, "exec", sid, "--", "sh", "-c", "echo kept > /tmp/mark")
        assert marked.returncode == 0, marked.stderr
        paused = aenv(cli_env, "pause", sid)
        assert paused.returncode == 0, paused.stderr
        twice = aenv(cli_env, "pause", sid)
        assert twice.returncode == 1 and "paused" in twice.stderr
        assert len(twice.stderr.strip().splitlines()) == 1
        resumed = aenv(cli_env, "resume", sid)
        assert resumed.returncode == 0, resumed.stderr
        mark = aenv(cli_env, "exec", sid, "--", "cat", "/tmp/mark")
        assert (mark.returncode, mark.stdout) == (0, "kept\n"), mark.stderr
        logs = aenv(cli_env, "logs", sid)
        assert "timeout set to 120s" in logs.stdout
        assert "paused" in logs.stdout and "resumed" in logs.stdout
    finally:
        assert aenv(cli_env, "rm", sid).returncode == 0
    again = aenv(cli_env, "rm", sid)
    assert again.returncode == 1 and "not found" in again.stderr
    assert len(again.stderr.strip().splitlines()) == 1
    assert aenv(cli_env, "exec", sid, "--", "true").returncode == 1
    missing = aenv(cli_env, "start", "-d", "no-such-template")
    assert missing.returncode == 1 and "no-such-template" in missing.stderr
