"""How a relayed stream ends when its sandbox is cut (killed, paused, dead): Connect envelope
tracking, so a cut between two frames ends with an `unavailable` end-of-stream frame as
E2B's proxy answers; line tracking of the code interpreter's answers, so one cut by a reset
between two lines ends with an execution error saying so; and the awaits that give way to a
cut (`unless_cut`). Split from `forward.py`."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")
# A Connect streaming response (`application/connect+json`, `+proto`): 5-byte-prefixed frames.
CONNECT_STREAM = "application/connect+"
_END_STREAM_FLAG = 0b10


class EnvelopeTracker:
    """Where a relayed Connect stream stands in its framing (a 1-byte flag, a 4-byte
    big-endian length, the payload), so a cut stream can be closed at a frame boundary."""

    def __init__(self) -> None:
        self._prefix = bytearray()
        self._remaining = 0

    def advance(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            if len(self._prefix) < 5:
                take = 5 - len(self._prefix)
                self._prefix += view[:take]
                view = view[take:]
                if len(self._prefix) == 5:
                    self._remaining = int.from_bytes(self._prefix[1:5], "big")
            else:
                step = min(len(view), self._remaining)
                self._remaining -= step
                view = view[step:]
            if len(self._prefix) == 5 and self._remaining == 0:
                self._prefix.clear()

    @property
    def at_boundary(self) -> bool:
        return not self._prefix and self._remaining == 0


class LineTracker:
    """Whether a relayed stream of lines (the code interpreter's `/execute` answer,
    `application/x-ndjson`: one JSON message per line) stands between two lines."""

    def __init__(self) -> None:
        self.at_boundary = True

    def advance(self, data: bytes) -> None:
        if data:
            self.at_boundary = data.endswith(b"\n")


# The code interpreter's streamed answer; its `error` line is what the SDKs turn into
# `Execution.error` (name, value, traceback).
NDJSON = "application/x-ndjson"
INTERRUPTED_NAME = "SandboxReset"


def interpreter_error_line(message: str) -> bytes:
    """An execution error line as the code interpreter writes one, ending an execution a
    reset cut: the SDK returns the execution with it as its error, where a dropped
    connection would leave it a bare protocol error (the sandbox still runs, so the SDK
    cannot call it killed)."""
    line = {"type": "error", "name": INTERRUPTED_NAME, "value": message, "traceback": message}
    return json.dumps(line).encode() + b"\n"


def connect_end_stream_error(message: str) -> bytes:
    """A Connect end-of-stream frame carrying an `unavailable` error."""
    body = json.dumps({"error": {"code": "unavailable", "message": message}}).encode()
    return bytes([_END_STREAM_FLAG]) + len(body).to_bytes(4, "big") + body


class Cut(asyncio.Event):
    """Set when an open request's sandbox is released. `why`: the sandbox lives on (a
    reset) and its clients are told this, with a clean end instead of a dropped connection."""

    why: str | None = None


class ClientGone(Exception):
    """The downstream client disconnected while we were relaying its request body."""


class SandboxGone(Exception):
    """The sandbox was paused or killed (or its VM died) while a request to it was open."""


async def unless_cut(step: Awaitable[T], cut: asyncio.Event) -> T:
    """Await `step` unless `cut` is set first. A paused or dead guest never answers (its
    slot may already be gone, so no reset comes either), so an open request must not wait
    for it: reads to guests have no deadline."""
    task = asyncio.ensure_future(step)
    waiter = asyncio.create_task(cut.wait())
    try:
        await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiter.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
    if task.cancelled() and cut.is_set():
        raise SandboxGone
    return task.result()
