"""The per-sandbox state machine: create, connect, pause, resume, timeouts, kill.

creating → running → pausing → paused → resuming → running … → killing → gone

Every transition is a compare-and-set on the stored state, taken while holding that sandbox's
lock, so concurrent requests for one sandbox run one after another and a request that loses the
race sees the state the winner left. A transition that fails part-way is rolled back (pause,
resume) or torn down to ``gone`` (create), never left in a transitional state.

`SandboxManager` is put together from its parts: `sandbox_base` (state, lock, value types),
`sandbox_creation`, `sandbox_lifecycle`, `sandbox_queries`, `sandbox_recovery`,
`sandbox_reaper` and `sandbox_reset`; this module starts and stops it.
"""

from __future__ import annotations

import asyncio
import contextlib

from agentenv.contract.errors import SandboxNotFound
from agentenv.control.sandbox_creation import SandboxCreation
from agentenv.control.sandbox_queries import SandboxQueries
from agentenv.control.sandbox_reaper import SandboxReaper
from agentenv.control.sandbox_recovery import SandboxRecovery
from agentenv.control.sandbox_reset import SandboxReset
from agentenv.control.store import LIVE_STATES, SandboxState


class SandboxManager(SandboxReaper, SandboxCreation, SandboxQueries, SandboxRecovery, SandboxReset):
    """Owns the lifecycle of every sandbox on this server."""

    async def start(self) -> None:
        if self.replicas is not None:
            # Registered before any row is stamped with the id: a stamp always names a
            # replica that was alive when it was written.
            await self.replicas.start()
        await self.runtime.start()
        self.runtime.watch_lost(self._runtime_lost)
        if not self.shared:
            await self._reconcile()
        elif self.replicas is not None:
            # A replica that starts beside others cannot tell their operations in flight from
            # a crashed one's by looking: the stamps and the replicas' leases tell.
            self._sweeper = asyncio.create_task(self._sweep_forever(), name="orphan-sweeper")
        self._reaper = asyncio.create_task(self._reap_forever(), name="sandbox-reaper")

    async def close(self) -> None:
        """Stop the reaper and tear down every running sandbox. Paused ones stay: the runtime
        keeps them on disk and the next server resumes them."""
        try:
            await self._close()
        finally:
            await self.limits.close()
            if self.replicas is not None:
                # Revoked last: what this replica leaves half-done is the others' at once.
                await self.replicas.close()

    async def _close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            await asyncio.gather(self._sweeper, return_exceptions=True)
            self._sweeper = None
        if self._reaper is not None:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
            self._reaper = None
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        # One server's sandboxes end with it; a cluster's live on its nodes, past any replica.
        for rec in (
            [] if self.shared else await self.store.select(LIVE_STATES - {SandboxState.PAUSED})
        ):
            with contextlib.suppress(SandboxNotFound):
                await self.kill(rec.id, reason="server shutdown")
        await self.runtime.close()
