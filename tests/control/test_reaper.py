"""The reaper outlives a failing store: a pass that raises is logged and the next tick runs.
No VM: the runtime holds nothing and the reaper only reads the store."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, cast

import pytest

from agentenv.contract.runtime import Runtime, TemplateSource
from agentenv.control import sandbox_reaper
from agentenv.control.sandboxes import SandboxManager
from agentenv.control.sqlite_store import SqliteStore
from agentenv.control.store import SandboxRecord


class EmptyRuntime:
    """What a manager's start and close ask of a runtime that holds no sandbox."""

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    def watch_lost(self, handler: Any) -> None:
        pass

    async def sandbox_ids(self) -> list[str]:
        return []


class FlakyStore(SqliteStore):
    """Fails the reaper's first reads: the deadline once, then a whole pass once."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.deadline_reads = 0
        self.passes = 0

    async def next_deadline(self) -> float | None:
        self.deadline_reads += 1
        if self.deadline_reads == 1:
            raise OSError("store unreachable")
        return await super().next_deadline()

    async def expired(self, now: float) -> list[SandboxRecord]:
        self.passes += 1
        if self.passes == 1:
            raise OSError("store unreachable")
        return await super().expired(now)


async def test_the_reaper_survives_failing_passes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sandbox_reaper, "_REAPER_TICK_S", 0.02)
    store = FlakyStore(tmp_path / "db.sqlite")
    mgr = SandboxManager(
        store,
        cast(Runtime, EmptyRuntime()),
        cast(TemplateSource, object()),
        envd_version="0.6.4",
    )
    await mgr.start()
    try:
        reaper = mgr._reaper
        assert reaper is not None
        async with asyncio.timeout(10):
            while store.passes < 3:
                assert not reaper.done(), "the reaper ended on a failing pass"
                await asyncio.sleep(0.02)
    finally:
        await mgr.close()
