"""Putting rows right after something died: reconcile at start (settle transitional rows
against the runtime), the orphan sweep of replicas sharing a store, and sandboxes the runtime
lost. Split from `sandboxes.py`."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from agentenv.control.ownership import RESTART, TRANSITIONAL, Settling, after_replica
from agentenv.control.sandbox_base import DEFAULT_TIMEOUT_S, LOST, _pause_mode
from agentenv.control.sandbox_reset import SandboxReset
from agentenv.control.store import LIVE_STATES, SandboxRecord, SandboxState

log = logging.getLogger("agentenv.sandboxes")


class SandboxRecovery(SandboxReset):
    """Reconcile, orphan sweep and lost sandboxes of the sandbox manager."""

    async def _reconcile(self) -> None:
        """Match the rows a previous server left with what the runtime re-adopted.

        Running and paused sandboxes carry on (ids, tokens, timeouts, metadata kept); rows
        in a transitional state are settled (`_settle`). Sandboxes the runtime holds that no
        row names (a fork cut short) are deleted."""
        named: set[str] = set()
        for rec in await self.store.select(LIVE_STATES):
            rid = await self._settle(rec, RESTART)
            if rid is not None:
                named.add(rid)
        for rid in await self.runtime.sandbox_ids():
            if rid not in named:
                log.warning("runtime sandbox %s belongs to no sandbox; deleting it", rid)
                with contextlib.suppress(Exception):
                    await self.runtime.delete(rid)

    async def _settle(self, rec: SandboxRecord, how: Settling) -> str | None:
        """Bring a row whose operation nobody runs any more in line with the runtime.

        A pause or resume cut short ends in the state the runtime finds the sandbox in
        (rolled forward or back there); a create or kill cut short is finished as a kill
        (the caller never got the sandbox, or asked for it to go). A row whose sandbox the
        runtime does not hold is lost, with the reason in its log. Every write is a
        compare-and-set from the state read: if another writer moved the row meanwhile,
        nothing more is done. Returns the sandbox id when the row still names a sandbox of the
        runtime (None once gone)."""
        rid = rec.id
        found = await self.runtime.find(rid)
        if rec.state is SandboxState.RESUMING and rec.reset_to is not None:
            return await self._finish_reset(rec, found)
        was = rec.state.value
        now = time.time()
        if found is None or rec.state in (SandboxState.CREATING, SandboxState.KILLING):
            state = rec.state
            if self.shared and state is SandboxState.CREATING and found is not None:
                # Killing while its VM goes: a replica that dies here leaves a kill (stamped
                # with its id) for the next sweep, not a create.
                if not await self.store.transition(rec.id, state, SandboxState.KILLING):
                    return None
                state = SandboxState.KILLING
            if found is not None:
                with contextlib.suppress(Exception):
                    await self.runtime.delete(rid)
            why = None
            if state not in (SandboxState.CREATING, SandboxState.KILLING):
                # Asked before the row goes: a node that cannot answer now raises here, and
                # the row stays for another try instead of being lost on a hiccup.
                why = await self.runtime.lost_reason(rid) or how.nothing
            if not await self.store.transition(rec.id, state, SandboxState.GONE):
                return None
            if rec.state is SandboxState.KILLING:
                await self.store.log(rec.id, how.killed)
            elif rec.state is SandboxState.CREATING:
                await self.store.log(rec.id, how.cut_short, "warn")
            else:
                await self.store.log(rec.id, f"{LOST}{why} (was {was})", "error")
            await self._released(rec.id)
            return None
        if found.state == "running" and found.placement is not None:
            # A resume cut short after the guest ran: the timeout it would have started
            # (its request's value is gone with the request).
            end_at = rec.end_at
            if rec.state in (SandboxState.RESUMING, SandboxState.PAUSED):
                end_at = now + DEFAULT_TIMEOUT_S
            if not await self.store.transition(
                rec.id,
                rec.state,
                SandboxState.RUNNING,
                address=found.placement.address,
                node_id=found.placement.node_id,
                envd_url=found.placement.envd_url,
                end_at=end_at,
                pause_mode=None,
            ):
                return rid
            await self.store.log(rec.id, how.running.format(was=was))
            if rec.state is SandboxState.RESUMING:
                # The cut may have come before the control plane's `/init`: a guest
                # booted from its disk would run with an envd that has no token yet.
                try:
                    await self.runtime.init_guest(self._spec(rec))
                except Exception as exc:
                    await self.store.log(rec.id, how.init_failed.format(exc=exc), "warn")
        elif found.state == "paused":
            if not await self.store.transition(
                rec.id,
                rec.state,
                SandboxState.PAUSED,
                address=None,
                end_at=min(rec.end_at, now),
                pause_mode=_pause_mode(found.memory),
            ):
                return rid
            if rec.state is not SandboxState.PAUSED:
                await self.store.log(rec.id, how.paused.format(was=was))
                if self.shared:
                    # Other replicas' proxies may hold connections to it: a paused guest
                    # answers nothing, so they are ended here.
                    await self._released(rec.id)
        return rid

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(self.sweep_period_s)
            try:
                await self.sweep_orphans()
            except Exception as exc:
                # etcd or a node out of reach: the next sweep tries again.
                log.warning("orphan sweep failed: %r", exc)

    async def sweep_orphans(self) -> list[str]:
        """Settle the rows left in a transitional state by replicas that are gone (seen so
        for the grace period); returns the ids this replica settled."""
        if self.replicas is None:
            return []
        # The rows first, then who is alive: a stamp in a row read here was written by a
        # replica registered before it, so one alive now is in the set read after.
        rows = await self.store.select(TRANSITIONAL)
        live = await self.replicas.live() if rows else set()
        if rows and self.replica_id not in live:
            # Our own lease is gone (etcd out of reach, or this process stalled): we are the
            # one that may look dead, and must not judge the others until registered again.
            log.warning("replica %s: not registered; orphan sweep skipped", self.replica_id)
            return []
        orphans = [r for r in rows if r.replica_id not in live]
        settled: list[str] = []
        for rec in self._orphans.due(orphans, time.monotonic()):
            try:
                if await self._take_over(rec):
                    settled.append(rec.id)
            except Exception as exc:
                log.warning("sandbox %s: taking over its %s failed: %r", rec.id, rec.state, exc)
            self._orphans.forget(rec.id)
        return settled

    async def _take_over(self, rec: SandboxRecord) -> bool:
        assert self.replica_id is not None
        async with self._locked(rec.id):
            # Of replicas sweeping at once, one stamps the row; the others find the stamp
            # changed (or the row moved on) and leave it.
            if not await self.store.claim(rec.id, rec.state, rec.replica_id, self.replica_id):
                return False
            owner = rec.replica_id or "none"
            log.warning(
                "sandbox %s: %s left by replica %s, which is gone; settling it",
                rec.id,
                rec.state.value,
                owner,
                extra={"sandbox_id": rec.id},
            )
            await self.store.log(
                rec.id, f"replica {self.replica_id} settles the {rec.state.value} of {owner}"
            )
            current = await self.store.get(rec.id)
            if current is None or current.state is not rec.state:
                return False
            try:
                await self._settle(current, after_replica(rec.replica_id))
            except BaseException:
                # Stamped with a live replica, the row would never be swept again: the old
                # stamp goes back, so a later sweep (this one's or another's) tries again.
                with contextlib.suppress(Exception):
                    await self.store.update(rec.id, replica_id=rec.replica_id)
                raise
        return True

    def _runtime_lost(self, sandbox_id: str, why: str) -> None:
        """The runtime says a running sandbox's VM ended on its own."""
        task = asyncio.create_task(self._lose(sandbox_id, why), name=f"lost-{sandbox_id}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _lose(self, sandbox_id: str, why: str) -> None:
        rec = await self.store.get(sandbox_id)
        if rec is None or rec.state is SandboxState.GONE:
            with contextlib.suppress(Exception):
                await self.runtime.delete(sandbox_id)
            return
        async with self._locked(sandbox_id):
            rec = await self.store.get(sandbox_id)
            # An operation holding the lock may have replaced the VM meanwhile (a resume).
            if (
                rec is None
                or rec.state is not SandboxState.RUNNING
                or await self.runtime.is_alive(sandbox_id)
            ):
                return
            self.metrics.sandboxes_lost.inc()
            # Logged first: from here on every request for it is told why it is gone.
            await self.store.log(rec.id, f"{LOST}{why}", "error")
            await self._kill_locked(rec, "its resources were released")
