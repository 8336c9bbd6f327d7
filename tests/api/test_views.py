"""The states the API shows: the SDKs know only "running" and "paused", so a transition shows
as the state it came from."""

from __future__ import annotations

import dataclasses
import time

from agentenv.api.views import listed_state
from agentenv.control.store import SandboxRecord, SandboxState


def _record(state: SandboxState, reset_to: str | None = None) -> SandboxRecord:
    now = time.time()
    rec = SandboxRecord(
        id="iviews00000000000000", template="base", alias="base", state=state,
        started_at=now, end_at=now + 600, cpu=1, memory_mb=512, disk_mb=1024, envd_version="0.6.4",
    )  # fmt: skip
    return dataclasses.replace(rec, reset_to=reset_to)


def test_a_reset_under_way_shows_running_and_a_resume_paused() -> None:
    assert listed_state(_record(SandboxState.RESUMING, reset_to="base")) == "running"
    assert listed_state(_record(SandboxState.RESUMING)) == "paused"
    assert listed_state(_record(SandboxState.PAUSING)) == "running"
    assert listed_state(_record(SandboxState.RUNNING)) == "running"
    assert listed_state(_record(SandboxState.PAUSED)) == "paused"
    assert listed_state(_record(SandboxState.KILLING)) is None
    assert listed_state(_record(SandboxState.GONE)) is None
