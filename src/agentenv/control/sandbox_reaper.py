"""Timeouts: the reaper pauses or kills sandboxes whose timeout passed, and deletes paused ones
past the retention limit. Split from `sandboxes.py`; it acts through the lifecycle's
transitions."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from agentenv.contract.errors import Conflict, NotSupported, SandboxNotFound
from agentenv.control.sandbox_base import _REAPER_TICK_S
from agentenv.control.sandbox_lifecycle import SandboxLifecycle
from agentenv.control.store import SandboxRecord, SandboxState

log = logging.getLogger("agentenv.sandboxes")


class SandboxReaper(SandboxLifecycle):
    """The timeout reaper of the sandbox manager."""

    async def _reap_forever(self) -> None:
        while True:
            deadline = await self.store.next_deadline()
            wait = _REAPER_TICK_S
            if deadline is not None:
                wait = min(wait, max(0.0, deadline - time.time()))
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout=wait)
            await self.reap_expired()

    async def reap_expired(self) -> None:
        await self._reap_paused()
        for rec in await self.store.expired(time.time()):
            try:
                await self._expire(rec.id)
            except Exception as exc:
                log.error("sandbox %s expiry failed: %r", rec.id, exc)

    async def _reap_paused(self) -> None:
        """Paused sandboxes past their retention go, with everything only they held."""
        now = time.time()
        if self.paused_retention_s <= 0 or now - self._retention_checked < self.retention_check_s:
            return
        self._retention_checked = now
        for rec in await self.store.select([SandboxState.PAUSED]):
            if self._retention_over(rec, now):
                try:
                    await self._collect_paused(rec.id)
                except Exception as exc:
                    # One sandbox that cannot be deleted must not stop the reaper.
                    log.error("sandbox %s retention delete failed: %r", rec.id, exc)

    def _retention_over(self, rec: SandboxRecord, now: float) -> bool:
        return rec.end_at + self.paused_retention_s <= now

    async def _collect_paused(self, sandbox_id: str) -> None:
        async with self._locked(sandbox_id):
            rec = await self.store.get(sandbox_id)
            # The rows were read before earlier deletions awaited: a connect may have resumed
            # this one, or a new timeout moved its deadline, in the meantime.
            if (
                rec is None
                or rec.state is not SandboxState.PAUSED
                or not self._retention_over(rec, time.time())
            ):
                return
            await self._kill_locked(rec, "paused longer than the retention limit")

    async def _expire(self, sandbox_id: str) -> None:
        async with self._locked(sandbox_id):
            rec = await self.store.get(sandbox_id)
            # The deadline may have moved while we waited for the lock.
            if rec is None or rec.state is not SandboxState.RUNNING or rec.end_at > time.time():
                return
            auto_pause, memory = rec.auto_pause, rec.auto_pause_memory
        if auto_pause:
            try:
                await self.pause(sandbox_id, memory=memory, strict=False)
                await self.store.log(sandbox_id, "paused on timeout")
                return
            except NotSupported as exc:
                await self.store.log(sandbox_id, f"auto-pause unavailable ({exc}); killing", "warn")
            except (Conflict, SandboxNotFound):
                return
        with contextlib.suppress(SandboxNotFound):
            await self.kill(sandbox_id, reason="killed on timeout")
