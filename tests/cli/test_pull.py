"""`aenv pull` without a server: the default template name, and the errors that need no VM
(the end-to-end pull is tests/e2e/test_cli_pull.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from agentenv.api.devserver import free_port
from agentenv.cli.build import default_name
from agentenv.cli.connection import ClientError

AENV = [sys.executable, "-m", "agentenv.cli"]


@pytest.mark.parametrize(
    ("ref", "name"),
    [
        ("ubuntu", "ubuntu"),
        ("python:3.11-slim", "python-3.11-slim"),
        ("ghcr.io/org/tools/app:latest", "app"),
        ("127.0.0.1:5000/team/my_app:V1.2", "my_app-v1.2"),
        ("busybox@sha256:" + "ab" * 32, "busybox-abababababab"),
        ("x" * 70 + ":1", "x" * 63),
    ],
)
def test_default_name_from_the_reference(ref: str, name: str) -> None:
    assert default_name(ref) == name


def test_an_invalid_reference_is_one_error() -> None:
    with pytest.raises(ClientError, match="must be lowercase"):
        default_name("Ubuntu")


def _aenv(*args: str, url: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("E2B_", "AGENTENV_"))}
    env.update(AGENTENV_URL=url, AGENTENV_API_KEY="aenv_test")
    return subprocess.run(
        [*AENV, *args], env=env, capture_output=True, text=True, timeout=60, check=False
    )


def test_unreachable_server_is_one_line_and_exit_1() -> None:
    got = _aenv("pull", "busybox", url=f"http://127.0.0.1:{free_port()}")
    assert got.returncode == 1
    lines = got.stderr.strip().splitlines()
    assert len(lines) == 1 and "cannot reach the agentenv server" in lines[0], got.stderr


def test_username_without_password_is_refused_before_any_request() -> None:
    got = _aenv("pull", "busybox", "--username", "bob", url=f"http://127.0.0.1:{free_port()}")
    assert got.returncode == 1
    assert "--username and --password" in got.stderr and "cannot reach" not in got.stderr
