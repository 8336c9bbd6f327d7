"""agentenv.pump.both_ways on in-memory flows: a half-closed direction lets the other go on,
an end that cannot be passed on or a failure cuts the other."""

from __future__ import annotations

import asyncio

import pytest

from agentenv.pump import Flow, both_ways


class Pipe:
    """A direction fed by the test: `feed` chunks, `close` for the source's end."""

    def __init__(self, changed: asyncio.Event, *, half_close: bool = True) -> None:
        self.inbox: asyncio.Queue[bytes | Exception] = asyncio.Queue()
        self.out: list[bytes] = []
        self.ended = False
        self.half_close = half_close
        self.changed = changed  # set on every write and end

    async def read(self) -> bytes:
        item = await self.inbox.get()
        if isinstance(item, Exception):
            raise item
        return item

    async def write(self, data: bytes) -> None:
        self.out.append(data)
        self.changed.set()

    def end(self) -> bool:
        self.ended = True
        self.changed.set()
        return self.half_close

    def flow(self) -> Flow:
        return Flow(self.read, self.write, self.end)


async def test_a_half_close_lets_the_other_direction_go_on() -> None:
    changed = asyncio.Event()
    up, down = Pipe(changed), Pipe(changed)
    relay = asyncio.create_task(both_ways(up.flow(), down.flow()))
    up.inbox.put_nowait(b"request")
    up.inbox.put_nowait(b"")
    down.inbox.put_nowait(b"answer")
    async with asyncio.timeout(10):
        while not (up.ended and down.out):
            changed.clear()
            await changed.wait()
    assert not relay.done()
    down.inbox.put_nowait(b"")
    async with asyncio.timeout(10):
        await relay
    assert (up.out, down.out, down.ended) == ([b"request"], [b"answer"], True)


@pytest.mark.parametrize("how", ["no half-close", "failure"])
async def test_an_end_without_half_close_or_a_failure_cuts_the_other(how: str) -> None:
    changed = asyncio.Event()
    up, down = Pipe(changed, half_close=how != "no half-close"), Pipe(changed)
    relay = asyncio.create_task(both_ways(up.flow(), down.flow()))
    up.inbox.put_nowait(b"" if how == "no half-close" else ConnectionResetError("reset"))
    async with asyncio.timeout(10):
        await relay  # the failure is not raised: the relay is just over
    assert not down.ended
