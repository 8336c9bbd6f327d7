"""A real server process (`python -m agentenv.api`) whose sandboxes are QEMU microVMs.

One server per module: its start (slot pool, guest artifacts from the cache) costs a few
seconds, and tests that never create a sandbox run against it without booting anything.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import TypeVar

import httpx
import pytest

from agentenv.api.devserver import ServerProcess
from agentenv.control.sqlite_store import SqliteStore
from agentenv.control.store import SandboxRecord, Store
from agentenv.template.datadir import prepare_home
from agentenv.vmm import registry

T = TypeVar("T")

# Generous: a create boots a VM under software emulation while other tests share the CPUs.
REQUEST_TIMEOUT_S = 300.0


def on_store(db: Path, fn: Callable[[Store], Awaitable[T]]) -> T:
    """`fn(store)` on a server's SQLite store, from a sync test (the store is async): a
    connection of its own, opened and closed around the call."""

    async def run() -> T:
        store = SqliteStore(db)
        try:
            return await fn(store)
        finally:
            await store.close()

    return asyncio.run(run())


def stored_row(home: Path, sandbox_id: str) -> SandboxRecord | None:
    """The row a server in `home` keeps for a sandbox (read from outside, from a sync test)."""
    return on_store(home / "agentenv.db", lambda store: store.get(sandbox_id))


def qemu_processes(home: Path, *, warm: bool = False, converters: bool = False) -> list[str]:
    """QEMU processes whose command line points into ``home`` (a server's sandboxes); those
    of its warm pool (waiting in ``home/warm``, not sandboxes yet) only with ``warm``, and
    those converting a paused sandbox's RAM stream (in ``<workdir>/convert``, no guest runs
    in them) only with ``converters``."""
    found = []
    warm_dir = str(home / "warm") + "/"
    for pid, cmd in registry.qemu_processes(str(home)).items():
        if (warm or warm_dir not in cmd) and (converters or "/convert/" not in cmd):
            found.append(f"{pid} {cmd[:100]}")
    return found


def env_unchanged() -> None:
    """What `use_sdk_env` returns before it has run (a fixture that failed earlier)."""


def use_sdk_env(srv: ServerProcess) -> Callable[[], None]:
    """Point the SDK (E2B_API_URL, E2B_SANDBOX_URL, E2B_API_KEY) at `srv`; the returned
    function puts back what was there before."""
    saved = {k: os.environ.get(k) for k in srv.sdk_env()}
    os.environ.update(srv.sdk_env())

    def restore() -> None:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v

    return restore


def stop_and_check(srv: ServerProcess) -> None:
    """Stop the server and fail if it did not shut down cleanly or left a VM behind."""
    code = srv.stop(timeout_s=120)
    # uvicorn re-raises the SIGTERM it handled once shutdown is complete.
    assert code in (0, -signal.SIGTERM), f"server exited with {code}: {srv.log_tail()}"
    assert "Application shutdown complete" in srv.log_tail(40)
    assert not qemu_processes(srv.home, warm=True, converters=True), (
        "server left QEMU processes behind"
    )
    sandboxes = srv.home / "sandboxes"
    assert not (sandboxes.is_dir() and os.listdir(sandboxes)), "server left sandbox dirs"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    home = prepare_home(tmp_path_factory.mktemp("api-home"))
    srv = ServerProcess(home, domain="sbx.test", ready_timeout_s=180).start()
    try:
        yield srv
    finally:
        stop_and_check(srv)
    # Clean: its disks and RAM files go now, not when the run's temp dir does.
    shutil.rmtree(home, ignore_errors=True)


@pytest.fixture
def api(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(
        base_url=server.url, headers={"X-API-Key": server.api_key}, timeout=REQUEST_TIMEOUT_S
    ) as client:
        yield client


def db_path(server: ServerProcess) -> Path:
    return server.home / "agentenv.db"
