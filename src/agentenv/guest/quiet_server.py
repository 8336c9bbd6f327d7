"""uvicorn's server, waking once a second instead of ten times: the guest's HTTP servers
(envd; the code interpreter) and the host's (the API server, a node agent's RPC server).

uvicorn's main loop sleeps 0.1 s between housekeeping ticks: it refreshes the Date header
every tenth one and looks at `should_exit` on each. In a guest under TCG every wakeup of the
Python loop runs in emulation: those ticks were most of what an idle sandbox costs its host.
Its QEMU's CPU, 3 idle sandboxes, 30 s (2026-12-07): 28 and 54-58 ms per second with them,
9-11 ms with this loop. On the host they were a third of an idle API server's wakeups, and
what an idle server spends lands on every operation it serves meanwhile (#23). Here the loop
ticks once a second (the Date header stays as fresh), and a signal or `request_exit` ends
the wait at once, so a shutdown does not wait for the next tick.

The host imports it from here: the guest's side may import nothing else of ours (the tools
layer packs this package alone), so this is where the one copy can live.

The code interpreter imports nothing from `agentenv` (its template copies its package alone
and runs it on the guest's own Python), so `guest/interpreter/quiet_server.py` is a symlink
to this file: one source, copied into that template with the package's other modules.
"""

from __future__ import annotations

import asyncio
import contextlib
from types import FrameType

import uvicorn

TICK_S = 1.0
# `Server.on_tick` refreshes the Date header when its counter is a multiple of this.
_TICKS_PER_DATE = 10


class Server(uvicorn.Server):
    _loop: asyncio.AbstractEventLoop | None = None
    _wake: asyncio.Event | None = None

    async def main_loop(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        counter = 0
        while not await self.on_tick(counter):
            counter = (counter + _TICKS_PER_DATE) % 864_000
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), TICK_S)

    def request_exit(self) -> None:
        """Stop serving, from the loop's own thread (a caller that runs the server as a task
        of its own loop): what a signal does, without one."""
        self.should_exit = True
        if self._wake is not None:
            self._wake.set()

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        super().handle_exit(sig, frame)
        # Called by the signal handler on the loop's thread: the self-pipe wakes the loop.
        if self._loop is not None and self._wake is not None:
            self._loop.call_soon_threadsafe(self._wake.set)
