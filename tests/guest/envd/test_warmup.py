"""A template's warm-up (`snapshot.warmup`) against a real envd: every step succeeds and
leaves nothing behind, and one that cannot (no such user) is reported, not raised."""

from __future__ import annotations

import asyncio
from pathlib import Path

from agentenv.snapshot.warmup import PROBE, warm_up

from .conftest import EnvdProc


async def test_warm_up_runs_every_step_and_leaves_nothing(envd: EnvdProc) -> None:
    assert await warm_up(envd.url) == []
    assert not await asyncio.to_thread(Path(PROBE).exists)


async def test_warm_up_reports_what_failed_and_goes_on(envd: EnvdProc) -> None:
    failed = await warm_up(envd.url, user="no-such-user")
    assert [why.split(":")[0] for why in failed] == [
        "a command",
        "a file write",
        "a file read",
        "its removal",
    ], failed
