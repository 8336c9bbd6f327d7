"""Timeouts: the reaper pauses or kills sandboxes whose timeout passed, deletes paused ones
past the retention limit or their grace period, and kills those whose client went away (no
touch within their keepalive). Split from `sandboxes.py`; it acts through the lifecycle's
transitions."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

from agentenv.contract.errors import Conflict, NotSupported, SandboxNotFound
from agentenv.control.sandbox_base import _REAPER_TICK_S
from agentenv.control.sandbox_lifecycle import SandboxLifecycle
from agentenv.control.store import SandboxRecord, SandboxState

log = logging.getLogger("agentenv.sandboxes")

# How often grace periods and keepalives are checked (and touches stored): the precision of
# both, and one store write per touched sandbox at most this often.
_CHECK_S = 2.0


class SandboxReaper(SandboxLifecycle):
    """The timeout reaper of the sandbox manager."""

    async def _reap_forever(self) -> None:
        # A pass that fails (a store down for a while, a row it cannot read) is logged and the
        # next tick tries again: an exception that left this loop would end every timeout,
        # retention and keepalive of the server for good, silently.
        while True:
            wait = _REAPER_TICK_S
            try:
                deadline = await self.store.next_deadline()
            except Exception as exc:
                log.error("reaper: reading the next deadline failed: %r", exc)
                deadline = None
            if deadline is not None:
                wait = min(wait, max(0.0, deadline - time.time()))
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout=wait)
            try:
                await self.reap_expired()
            except Exception as exc:
                log.error("reaper pass failed, tried again at the next tick: %r", exc)

    async def reap_expired(self) -> None:
        await self._reap_paused()
        await self._reap_unattended()
        for rec in await self.store.expired(time.time()):
            try:
                await self._expire(rec.id)
            except Exception as exc:
                log.error("sandbox %s expiry failed: %r", rec.id, exc)

    async def _reap_unattended(self) -> None:
        """Store the touches seen since the last check; kill running sandboxes whose
        keepalive passed without one, and delete paused ones whose grace period is over."""
        now = time.time()
        if now - self._keepalive_checked < _CHECK_S:
            return
        if self._unattended_rows is False and not self._touched:
            return
        self._keepalive_checked = now
        touched, self._touched = self._touched, {}
        for sandbox_id, at in touched.items():
            try:
                await self.store.update(sandbox_id, seen_at=at)
            except Exception as exc:
                # Kept for the next check: a store that failed once must not cost a live
                # sandbox its keepalive.
                self._touched.setdefault(sandbox_id, at)
                log.warning("sandbox %s: storing its last touch failed: %r", sandbox_id, exc)
        running = await self.store.select([SandboxState.RUNNING])
        paused = await self.store.select([SandboxState.PAUSED])
        self._unattended_rows = any(r.keepalive_s or r.grace_s for r in [*running, *paused])
        for rec in running:
            if rec.keepalive_s and self._unattended(rec, now):
                try:
                    await self._reap_one(rec.id, self._unattended, "no client for its keepalive")
                except Exception as exc:
                    log.error("sandbox %s keepalive kill failed: %r", rec.id, exc)
        for rec in paused:
            if rec.grace_until and self._retention_over(rec, now):
                try:
                    await self._collect_paused(rec.id)
                except Exception as exc:
                    log.error("sandbox %s grace delete failed: %r", rec.id, exc)

    def _unattended(self, rec: SandboxRecord, now: float) -> bool:
        if self.open_requests(rec.id):
            self.touch(rec)
            return False
        seen = max(rec.seen_at, rec.started_at, self._touched.get(rec.id, 0.0))
        return rec.state is SandboxState.RUNNING and seen + rec.keepalive_s <= now

    async def _reap_one(
        self, sandbox_id: str, due: Callable[[SandboxRecord, float], bool], reason: str
    ) -> None:
        async with self._locked(sandbox_id):
            rec = await self.store.get(sandbox_id)
            # Read again under the lock: a touch or a kill may have come in between.
            if rec is None or not due(rec, time.time()):
                return
            await self._kill_locked(rec, reason)

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
        if rec.grace_until and rec.grace_until >= rec.end_at:
            # Paused at its timeout for its grace period: that, not the retention, is its end.
            return rec.grace_until <= now
        return self.paused_retention_s > 0 and rec.end_at + self.paused_retention_s <= now

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
            auto_pause, memory, grace = rec.auto_pause, rec.auto_pause_memory, rec.grace_s
        if auto_pause or grace:
            try:
                # A grace period keeps the memory: the scorer that connects finds the guest
                # as it was.
                if grace:
                    # Set before the pause too, so the scorer's reads that wait out the pause
                    # (the proxy waits for `pausing` to end) find it in its grace at once.
                    await self.store.update(sandbox_id, grace_until=time.time() + grace)
                await self.pause(sandbox_id, memory=memory or bool(grace), strict=False)
                if grace:
                    # The grace counts from the end of the pause.
                    await self.store.update(sandbox_id, grace_until=time.time() + grace)
                await self.store.log(
                    sandbox_id,
                    f"paused on timeout for its grace period ({grace} s)"
                    if grace
                    else "paused on timeout",
                )
                return
            except NotSupported as exc:
                await self.store.log(sandbox_id, f"auto-pause unavailable ({exc}); killing", "warn")
            except (Conflict, SandboxNotFound):
                if grace:
                    # No timeout pause happened (a kill or the client's own pause came
                    # first): nothing is in a grace.
                    try:
                        await self.store.update(sandbox_id, grace_until=0.0)
                    except Exception as exc:
                        log.warning("sandbox %s: clearing its grace failed: %r", sandbox_id, exc)
                return
        with contextlib.suppress(SandboxNotFound):
            await self.kill(sandbox_id, reason="killed on timeout")
