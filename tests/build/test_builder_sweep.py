"""Unfinished builds nobody runs are failed, and only those: on one server every one a
previous process left; in a cluster each whose runner (a replica) is not alive."""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Any

from agentenv.build.builder import Builder
from agentenv.build.state import BuildRecord, BuildState
from agentenv.config import Settings


class Manager:
    """What the sweep uses of the sandbox manager: kill (of the build sandbox). No build
    runs, so its runtime (what the build's guest calls go to) is never called."""

    def __init__(self) -> None:
        self.killed: list[str] = []
        self.runtime = None

    async def kill(self, sandbox_id: str, *, reason: str = "") -> None:
        self.killed.append(sandbox_id)


def _build(status: str, runner: str | None) -> BuildRecord:
    rec = BuildRecord(
        str(uuid.uuid4()),
        "app",
        status,
        time.time(),
        spec={"steps": []},
        runner=runner,
        sandbox_id="sbx-" + uuid.uuid4().hex[:6],
    )
    return rec


async def _put(state: BuildState, rec: BuildRecord) -> BuildRecord:
    await state.put_build(rec)
    return rec


async def test_a_cluster_replica_fails_only_the_builds_of_dead_runners(
    tmp_path: Path, settings: Settings
) -> None:
    state = BuildState(tmp_path / "b")
    mine = await _put(state, _build("building", "me"))
    alive = await _put(state, _build("building", "other"))
    dead = await _put(state, _build("building", "gone"))
    done = await _put(state, _build("ready", "gone"))
    manager = Manager()

    async def live() -> set[str]:
        return {"me", "other"}

    builder = Builder(manager, settings, state, runner="me", live_runners=live, shared=True)  # type: ignore[arg-type]
    await builder._fail_orphans()
    status = {r.build_id: r.status for r in await state.builds()}
    assert status == {mine.build_id: "building", alive.build_id: "building",
                      dead.build_id: "error", done.build_id: "ready"}  # fmt: skip
    assert manager.killed == [dead.sandbox_id]
    failed = await state.build(dead.build_id)
    assert failed is not None and failed.reason is not None
    assert "replica" in failed.reason["message"]
    assert any("interrupted" in ln.message for ln in await state.logs(dead.build_id))
    # Sweeping again changes nothing (the record is settled once).
    await builder._fail_orphans()
    assert manager.killed == [dead.sandbox_id]


async def test_without_knowing_who_is_alive_a_cluster_replica_fails_nothing(
    tmp_path: Path, settings: Settings
) -> None:
    state = BuildState(tmp_path / "b")
    rec = await _put(state, _build("building", "someone"))
    builder = Builder(Manager(), settings, state, shared=True)  # type: ignore[arg-type]
    await builder._fail_orphans()
    got = await state.build(rec.build_id)
    assert got is not None and got.status == "building"


async def test_one_server_fails_every_build_a_previous_process_left(
    tmp_path: Path, settings: Settings
) -> None:
    state = BuildState(tmp_path / "b")
    left = await _put(state, _build("building", None))
    asked = await _put(state, _build("waiting", None))
    # Requested, never started: the client may still start it.
    requested = await _put(state, replace_spec(_build("waiting", None)))
    manager = Manager()
    await Builder(manager, settings, state)._fail_orphans()  # type: ignore[arg-type]
    status: dict[str, Any] = {r.build_id: r.status for r in await state.builds()}
    assert status[left.build_id] == "error" and status[asked.build_id] == "error"
    assert status[requested.build_id] == "waiting"
    assert sorted(manager.killed) == sorted([left.sandbox_id, asked.sandbox_id])


def replace_spec(rec: BuildRecord) -> BuildRecord:
    rec.spec = None
    return rec
