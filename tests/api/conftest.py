"""A real server process (`python -m agentenv.api --runtime local`): sandboxes are envd
processes on 127.77.x.y, so the whole HTTP surface runs without booting VMs."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from agentenv.api.devserver import ServerProcess


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    home = tmp_path_factory.mktemp("api-home")
    srv = ServerProcess(home, runtime="local", domain="sbx.test").start()
    try:
        yield srv
    finally:
        code = srv.stop()
        # uvicorn re-raises the SIGTERM it handled once shutdown is complete.
        assert code in (0, -signal.SIGTERM), f"server exited with {code}: {srv.log_tail()}"
        assert "Application shutdown complete" in srv.log_tail(40)
        assert not envd_processes(home), "server left envd processes behind"


@pytest.fixture
def api(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(
        base_url=server.url, headers={"X-API-Key": server.api_key}, timeout=30.0
    ) as client:
        yield client


def db_path(server: ServerProcess) -> Path:
    return server.home / "agentenv.db"


def envd_processes(home: Path) -> list[int]:
    """PIDs of local-runtime envd processes (or their commands) working under ``home``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cwd = (entry / "cwd").resolve()
        except OSError:
            continue
        if str(cwd).startswith(str(home / "run" / "local")):
            found.append(int(entry.name))
    return found
