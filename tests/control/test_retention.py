"""Retention GC of paused sandboxes in the state machine, with real microVMs behind it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from agentenv.config import Settings
from agentenv.contract.errors import SandboxNotFound
from agentenv.control.sandbox_base import CreateSpec
from agentenv.control.sandboxes import SandboxManager
from agentenv.control.sqlite_store import SqliteStore
from agentenv.control.store import SandboxState
from agentenv.guest.envd.client import EnvdClient
from agentenv.node.runtime import CatalogTemplates, NodeRuntime

pytestmark = pytest.mark.vm

RETENTION_S = 1.0


@pytest.fixture
async def mgr(
    settings: Settings, base_template: object, tmp_path: Path
) -> AsyncIterator[SandboxManager]:
    # The background reaper checks retention once at start and then not for an hour: the
    # test decides when a sweep happens.
    m = SandboxManager(
        SqliteStore(tmp_path / "db.sqlite"),
        NodeRuntime(settings),
        CatalogTemplates(settings),
        envd_version="0.6.4",
        paused_retention_s=RETENTION_S,
        retention_check_s=3600.0,
    )
    await m.start()
    try:
        yield m
    finally:
        for rec in await m.store.select([SandboxState.PAUSED]):
            await m.kill(rec.id)
        await m.close()


async def test_sweep_spares_a_sandbox_resumed_while_it_ran(mgr: SandboxManager) -> None:
    """The sweep reads the paused rows, then deletes one after another; a connect that
    resumes a later one in the meantime wins, and the sweep must leave it running."""
    first = await mgr.create(CreateSpec(template="base", timeout=600))
    second = await mgr.create(CreateSpec(template="base", timeout=600))
    for rec in (first, second):
        await mgr.pause(rec.id)
        await mgr.set_timeout(rec.id, 0)
    await asyncio.sleep(RETENTION_S + 0.5)
    mgr.retention_check_s = 0.0
    # The sweep starts first and reads both rows before its first await (the first delete).
    _, (resumed, was_paused) = await asyncio.gather(mgr.reap_expired(), mgr.connect(second.id, 60))
    assert was_paused and resumed.state is SandboxState.RUNNING
    with pytest.raises(SandboxNotFound):
        await mgr.get(first.id)
    now = await mgr.get(second.id)
    assert now.state is SandboxState.RUNNING and now.envd_url
    async with EnvdClient(now.envd_url, access_token=now.envd_token) as guest:
        assert (await guest.run("echo alive")).stdout.strip() == "alive"
    await mgr.kill(second.id)


async def test_retention_counts_from_the_pause_not_from_the_timeout(mgr: SandboxManager) -> None:
    rec = await mgr.create(CreateSpec(template="base", timeout=3600))
    await mgr.pause(rec.id)
    paused = await mgr.get(rec.id)
    assert paused.end_at <= rec.end_at - 3000, "the hour left of the timeout does not count"
    await asyncio.sleep(RETENTION_S + 0.5)
    mgr.retention_check_s = 0.0
    await mgr.reap_expired()
    with pytest.raises(SandboxNotFound):
        await mgr.get(rec.id)
