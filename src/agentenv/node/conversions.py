"""Background conversion of paused sandboxes' RAM streams (`snapshot.pause.convert_stream`).

The first pause of a sandbox created from a template writes a full RAM stream (its RAM was a
private mapping of the template's). Loading that stream is most of a first resume (1.3 s for
256 MiB to 5.6 s for 1 GiB under TCG), so the node does it right after the pause, one
sandbox at a time so a burst of pauses does not take every core; a resume then loads device
state only. A resume of a sandbox whose conversion runs waits for it (`settle`: the work is
what the resume would do anyway); one still queued is dropped and the resume loads the
stream itself. A delete stops the conversion (`cancel`). Never both at once: the converter
and a resumed guest cannot both open the disk.
A conversion that fails is logged and left: the stream is still there and resume uses it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from pathlib import Path

from agentenv.snapshot.machine import GuestImage
from agentenv.snapshot.pause import convert_stream

log = logging.getLogger(__name__)


class PausedConversions:
    def __init__(self, image: Callable[[], GuestImage], parallel: int = 1) -> None:
        self._image = image
        self._slots = asyncio.Semaphore(parallel)
        self._tasks: dict[str, asyncio.Task[bool]] = {}
        self._running: set[str] = set()
        self.converted = 0
        self.failed = 0

    def start(self, sandbox_id: str, workdir: Path) -> None:
        """Convert in the background (a no-op for a sandbox already being converted)."""
        if sandbox_id in self._tasks:
            return
        task = asyncio.create_task(self._run(sandbox_id, workdir), name=f"convert-{sandbox_id}")
        self._tasks[sandbox_id] = task
        task.add_done_callback(lambda _: self._tasks.pop(sandbox_id, None))

    def busy(self, sandbox_id: str) -> bool:
        return sandbox_id in self._tasks

    async def _run(self, sandbox_id: str, workdir: Path) -> bool:
        async with self._slots:
            self._running.add(sandbox_id)
            try:
                done = await convert_stream(workdir, self._image())
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self.failed += 1
                log.warning("sandbox %s: RAM stream not converted: %s", sandbox_id, exc)
                return False
            finally:
                self._running.discard(sandbox_id)
            if done:
                self.converted += 1
                log.info("sandbox %s: paused RAM converted to a memory file", sandbox_id)
            return done

    async def settle(self, sandbox_id: str) -> None:
        """Until no conversion of this sandbox runs or waits: a running one is waited for
        (its outcome does not matter), a queued one dropped."""
        task = self._tasks.get(sandbox_id)
        if task is None:
            return
        if sandbox_id not in self._running:
            await self.cancel(sandbox_id)
            return
        with contextlib.suppress(Exception, asyncio.CancelledError):
            await asyncio.shield(task)

    async def wait(self, sandbox_id: str) -> None:
        """Until this sandbox's conversion, queued or running, has ended."""
        task = self._tasks.get(sandbox_id)
        if task is not None:
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await asyncio.shield(task)

    async def cancel(self, sandbox_id: str) -> None:
        """Stop a conversion of this sandbox and wait until its converter QEMU is gone."""
        task = self._tasks.get(sandbox_id)
        if task is None:
            return
        task.cancel()
        with contextlib.suppress(Exception, asyncio.CancelledError):
            await task

    async def close(self) -> None:
        for sandbox_id in list(self._tasks):
            await self.cancel(sandbox_id)
