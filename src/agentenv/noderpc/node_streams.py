"""What a `RemoteRuntime` keeps running in the background (`NodeStreams`): `note_activity`
batches ids and sends them without ever waiting, and `watch_lost` follows the node's
lost-sandbox stream, reconnecting when it breaks or falls silent. Split from `client.py`."""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncIterator, Callable

from connectrpc.errors import ConnectError

from agentenv.noderpc.channel import NodeChannel, T, log

from .gen import node_pb as pb

# note_activity: ids waiting to be sent at most (the oldest are dropped beyond), ids per
# call, and how long a first id waits for others to join its batch.
ACTIVITY_PENDING_MAX = 16384
ACTIVITY_BATCH = 2048
ACTIVITY_LINGER_S = 0.2
ACTIVITY_RETRY_S = 1.0
# WatchLost: reconnect backoff.
WATCH_BACKOFF_MIN_S = 0.2
WATCH_BACKOFF_MAX_S = 5.0


class NodeStreams(NodeChannel):
    """Activity batching and the lost-sandbox watch of one node."""

    def note_activity(self, sandbox_id: str) -> None:
        pending = self._activity
        if sandbox_id in pending:
            return
        if len(pending) >= ACTIVITY_PENDING_MAX:
            # Drop the oldest: the newest traffic is what decides whether a sandbox is idle.
            del pending[next(iter(pending))]
            self.activity_dropped += 1
        pending[sandbox_id] = None
        self._activity_wake.set()

    async def _send_activity(self) -> None:
        while True:
            await self._activity_wake.wait()
            await asyncio.sleep(ACTIVITY_LINGER_S)
            self._activity_wake.clear()
            while self._activity:
                batch: list[str] = []
                for sandbox_id in self._activity:
                    batch.append(sandbox_id)
                    if len(batch) >= ACTIVITY_BATCH:
                        break
                for sandbox_id in batch:
                    del self._activity[sandbox_id]
                try:
                    await self._note(batch)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:
                    task = asyncio.current_task()
                    if task is not None and task.cancelling():
                        # A cancel the RPC library turned into some other error mid-call:
                        # still a cancel (a close is waiting for this task to end).
                        raise asyncio.CancelledError from exc
                    # Activity is a hint: a node that missed it sees the next traffic. A node
                    # that is down is not asked again at once (nor logged about every time).
                    log.warning("node %s: %d activity notes lost: %s", self.url, len(batch), exc)
                    await asyncio.sleep(ACTIVITY_RETRY_S)

    async def _note(self, batch: list[str]) -> None:
        req = pb.NoteActivityRequest(sandbox_ids=batch)
        await self._call(
            "NoteActivity",
            self._query_s,
            lambda ms: self._client().note_activity(req, headers=self._headers, timeout_ms=ms),
        )

    def watch_lost(self, handler: Callable[[str, str], None]) -> None:
        self._handlers.append(handler)
        if self._rpc is not None:
            self._start_watch()

    def _start_watch(self) -> None:
        if self._watch_task is None or self._watch_task.done():
            self._watch_task = asyncio.create_task(self._watch())

    async def _watch(self) -> None:
        epoch, seq = "", 0
        backoff = WATCH_BACKOFF_MIN_S
        while True:
            try:
                stream = self._client().watch_lost(
                    pb.WatchLostRequest(epoch=epoch, after_seq=seq), headers=self._headers
                )
                async for event in _with_silence_limit(stream, self._watch_silence_s):
                    backoff = WATCH_BACKOFF_MIN_S
                    if event.epoch != epoch:
                        epoch, seq = event.epoch, 0
                    seq = max(seq, event.seq)
                    if not event.heartbeat:
                        self._deliver(event.sandbox_id, event.why)
                why = "stream ended"
            except asyncio.CancelledError:
                raise
            except TimeoutError:
                why = f"silent for {self._watch_silence_s:g} s"
            except ConnectError as err:
                task = asyncio.current_task()
                if task is not None and task.cancelling():
                    raise asyncio.CancelledError() from None
                why = f"{err.code.value}: {err.message}"
            except Exception as exc:
                why = f"{type(exc).__name__}: {exc}"
            log.info(
                "node %s: lost-sandbox stream broke (%s); again in %.1f s", self.url, why, backoff
            )
            await asyncio.sleep(backoff * random.uniform(0.8, 1.2))
            backoff = min(backoff * 2, WATCH_BACKOFF_MAX_S)

    def _deliver(self, sandbox_id: str, why: str) -> None:
        for handler in list(self._handlers):
            try:
                handler(sandbox_id, why)
            except Exception:
                log.exception("lost handler failed for %s", sandbox_id)


async def _with_silence_limit(stream: AsyncIterator[T], silence_s: float) -> AsyncIterator[T]:
    """`stream`'s items; TimeoutError if none comes for `silence_s` (then the stream is closed)."""
    it = aiter(stream)
    try:
        while True:
            try:
                async with asyncio.timeout(silence_s):
                    item = await anext(it)
            except StopAsyncIteration:
                return
            yield item
    finally:
        close = getattr(it, "aclose", None)
        if close is not None:
            with contextlib.suppress(Exception):
                await close()
