"""The builder's guest work goes through the `Runtime` contract: a COPY's files in pieces the
contract takes, a failed guest call as the step's failure (no VM: a recording runtime)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, cast

import pytest

from agentenv.build.guest_steps import GuestSteps
from agentenv.build.state import BuildRecord, BuildStore
from agentenv.build.steps import StepFailed
from agentenv.contract.runtime import GUEST_WRITE_MAX_BYTES, GuestCommand, GuestFailed, Runtime
from agentenv.control.store import SandboxRecord

MAX = GUEST_WRITE_MAX_BYTES


class Recorder:
    def __init__(self) -> None:
        self.writes: list[tuple[str, str | None, str, bytes, bool]] = []
        self.fail: Exception | None = None

    async def guest_write(
        self, sandbox_id: str, envd_token: str | None, path: str, data: bytes, *, append: bool
    ) -> None:
        self.writes.append((sandbox_id, envd_token, path, data, append))

    async def guest_run(self, sandbox_id: str, envd_token: str | None, command: GuestCommand,
                        on_line: Any) -> int:  # fmt: skip
        if self.fail is not None:
            raise self.fail
        on_line(f"ran {command.cmd}", "stdout")
        return 0


class Logs:
    def __init__(self) -> None:
        self.lines: list[tuple[str, str, str | None]] = []

    def log(
        self, build_id: str, message: str, level: str = "info", step: str | None = None
    ) -> None:
        self.lines.append((message, level, step))


def steps() -> tuple[GuestSteps, Recorder, Logs]:
    runtime, logs = Recorder(), Logs()
    return GuestSteps(cast(BuildStore, logs), cast(Runtime, runtime)), runtime, logs


SANDBOX = cast(SandboxRecord, type("Sb", (), {"id": "sb-1", "envd_token": "tok"})())
REC = cast(BuildRecord, type("Rec", (), {"build_id": "b-1"})())


@pytest.mark.parametrize(
    ("size", "pieces"),
    [(0, [0]), (10, [10]), (MAX, [MAX]), (MAX + 1, [MAX, 1]), (2 * MAX + 5, [MAX, MAX, 5])],
)
def test_an_upload_goes_in_pieces_the_first_replacing_the_rest_appending(
    tmp_path: Path, size: int, pieces: list[int]
) -> None:
    guest, runtime, _ = steps()
    data = bytes(i % 251 for i in range(size))
    local = tmp_path / "ctx.tar"
    local.write_bytes(data)
    asyncio.run(guest.upload(SANDBOX, local, "/tmp/ctx.tar"))
    assert [len(w[3]) for w in runtime.writes] == pieces
    assert [w[4] for w in runtime.writes] == [False] + [True] * (len(pieces) - 1)
    assert {(w[0], w[1], w[2]) for w in runtime.writes} == {("sb-1", "tok", "/tmp/ctx.tar")}
    assert b"".join(w[3] for w in runtime.writes) == data


def test_a_guest_call_the_runtime_could_not_make_fails_the_step() -> None:
    guest, runtime, logs = steps()
    assert asyncio.run(guest.sh(REC, SANDBOX, "echo hi", "2")) == 0
    assert logs.lines == [("ran echo hi", "info", "2")]
    runtime.fail = GuestFailed("sandbox sb-1: envd refused")
    with pytest.raises(StepFailed) as info:
        asyncio.run(guest.sh(REC, SANDBOX, "echo hi", "2"))
    assert info.value.step == "2" and "envd refused" in info.value.message
