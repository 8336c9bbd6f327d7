"""One both-ways byte pump for every relay of ours: the egress inspector (network/inspect),
the data gateway (gateway/server) and its client's socket tunnels (gateway/client).

Each direction is a `Flow`: read a chunk, write it on, and at the source's end pass that end on
as a half-close if the far side can take one. `both_ways` runs two flows until both have ended,
or until either fails or ends without a half-close (then the peer would wait for an end that
never comes), and cuts the other. It sits at the top of the package (it imports nothing of
ours) so the node side and the gateway, which may not import each other, share it."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

__all__ = ["Flow", "both_ways", "stream_flow"]


@dataclass(frozen=True)
class Flow:
    """One direction: `read` returns b"" at the source's end; `end` passes that end on and
    says whether it could (True: a half-close, the other direction goes on)."""

    read: Callable[[], Awaitable[bytes]]
    write: Callable[[bytes], Awaitable[None]]
    end: Callable[[], bool]


def stream_flow(src: asyncio.StreamReader, dst: asyncio.StreamWriter, chunk: int) -> Flow:
    """From an asyncio reader to a writer, half-closing `dst` at the end when it can (not over
    TLS, not once closing)."""

    async def write(data: bytes) -> None:
        dst.write(data)
        await dst.drain()

    def end() -> bool:
        if not dst.can_write_eof() or dst.is_closing():
            return False
        with contextlib.suppress(OSError, RuntimeError):
            dst.write_eof()
        return True

    return Flow(lambda: src.read(chunk), write, end)


async def _copy(flow: Flow) -> bool:
    while data := await flow.read():
        await flow.write(data)
    return flow.end()


async def both_ways(one: Flow, other: Flow) -> None:
    """Until both directions end, or either fails or cannot pass its end on (then the other
    is cut too). Never raises the flows' errors: a relay that ends by a reset is over, not a
    failure of the caller; a cancel of the caller cuts both."""
    tasks = [asyncio.create_task(_copy(one)), asyncio.create_task(_copy(other))]
    try:
        done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        if pending and all(
            not t.cancelled() and t.exception() is None and t.result() for t in done
        ):
            await asyncio.wait(pending, return_when=asyncio.FIRST_EXCEPTION)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
