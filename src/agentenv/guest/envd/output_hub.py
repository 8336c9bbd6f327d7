"""Output fan-out of a process started through envd: every Start or Connect stream is a
`Subscription` with a bounded queue on the process's `OutputHub`, which waits for each one
(a slow client slows the process instead of growing envd's memory) and delivers the end event
after the output. Split from `processes.py`."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Literal

QUEUE_DEPTH = 16
Stream = Literal["stdout", "stderr", "pty"]


@dataclass(frozen=True)
class EndInfo:
    exit_code: int
    exited: bool
    status: str
    error: str | None


@dataclass(frozen=True)
class Output:
    stream: Stream
    data: bytes


Event = Output | EndInfo


class Subscription:
    """One attached stream: a bounded queue of output, then the end."""

    def __init__(self, hub: OutputHub) -> None:
        self._hub = hub
        self.queue: asyncio.Queue[Event] = asyncio.Queue(QUEUE_DEPTH)
        self._end_put: asyncio.Task[None] | None = None

    def deliver_end(self, end: EndInfo) -> None:
        """The end is the last item; when the queue is full it waits for the reader."""
        try:
            self.queue.put_nowait(end)
        except asyncio.QueueFull:
            self._end_put = asyncio.create_task(self.queue.put(end))

    def close(self) -> None:
        self._hub.subscribers.discard(self)
        if self._end_put is not None:
            self._end_put.cancel()


@dataclass
class OutputHub:
    subscribers: set[Subscription] = field(default_factory=set)
    end: EndInfo | None = None

    def subscribe(self) -> Subscription:
        sub = Subscription(self)
        if self.end is not None:
            sub.queue.put_nowait(self.end)
        else:
            self.subscribers.add(sub)
        return sub

    async def publish(self, event: Event) -> None:
        for sub in list(self.subscribers):
            if sub in self.subscribers:
                await sub.queue.put(event)

    def finish(self, end: EndInfo) -> None:
        self.end = end
        for sub in list(self.subscribers):
            sub.deliver_end(end)
        self.subscribers.clear()
