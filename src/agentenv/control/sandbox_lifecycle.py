"""A running or paused sandbox's transitions, each a compare-and-set under the sandbox's lock:
kill, network and timeout changes, connect, resume, pause. Split from `sandboxes.py`."""

from __future__ import annotations

import time
from dataclasses import replace

from agentenv.contract.errors import (
    Conflict,
    SandboxLost,
    SandboxNotFound,
    Unavailable,
)
from agentenv.contract.runtime import Lost
from agentenv.control.sandbox_base import (
    DEFAULT_TIMEOUT_S,
    LOST,
    SandboxBase,
    _pause_mode,
    egress_of,
    raise_failure,
)
from agentenv.control.store import BUILD_METADATA, SandboxRecord, SandboxState
from agentenv.faults import crash_point


class SandboxLifecycle(SandboxBase):
    """Kill, pause, resume, connect and updates of the sandbox manager."""

    async def _envd_unhealthy(self, rec: SandboxRecord) -> str | None:
        """Why the sandbox's envd does not answer `/health` now, or None when it does."""
        return await self.runtime.guest_health(rec.id)

    async def kill(self, sandbox_id: str, *, reason: str = "killed") -> None:
        async with self._locked(sandbox_id):
            rec = await self.store.get(sandbox_id)
            if rec is None or rec.state is SandboxState.GONE:
                raise SandboxNotFound(sandbox_id)
            await self._kill_locked(rec, reason)

    async def update_network(
        self,
        sandbox_id: str,
        allow_internet: bool,
        allow_out: list[str],
        deny_out: list[str],
        dns_servers: list[str] | None = None,
    ) -> None:
        """Replace a running or paused sandbox's egress policy (omitted parts are cleared,
        as E2B does); it holds at once while the sandbox runs."""
        async with self._locked(sandbox_id):
            rec = await self.get(sandbox_id)
            if rec.state not in (SandboxState.RUNNING, SandboxState.PAUSED):
                raise Conflict(f"sandbox {sandbox_id} is {rec.state.value}")
            egress_keys = ("allowOut", "denyOut", "dnsServers")
            network = {k: v for k, v in rec.network.items() if k not in egress_keys}
            if allow_out:
                network["allowOut"] = allow_out
            if deny_out:
                network["denyOut"] = deny_out
            if dns_servers is not None:
                network["dnsServers"] = dns_servers
            updated = replace(rec, allow_internet=allow_internet, network=network)
            await self.runtime.update_egress(rec.id, egress_of(updated))
            await self.store.update(sandbox_id, allow_internet=allow_internet, network=network)
            await self.store.log(sandbox_id, f"network policy set: {egress_of(updated).to_json()}")

    async def set_timeout(self, sandbox_id: str, seconds: int) -> None:
        async with self._locked(sandbox_id):
            rec = await self.get(sandbox_id)
            if rec.state not in (SandboxState.RUNNING, SandboxState.PAUSED):
                raise Conflict(f"sandbox {sandbox_id} is {rec.state.value}")
            await self.store.update(sandbox_id, end_at=time.time() + seconds)
            await self.store.log(sandbox_id, f"timeout set to {seconds}s")
        self._wake.set()

    async def refresh(self, sandbox_id: str, duration: int) -> None:
        """Extend the sandbox's life to at least ``duration`` seconds from now."""
        async with self._locked(sandbox_id):
            rec = await self.get(sandbox_id)
            if rec.state is not SandboxState.RUNNING:
                raise Conflict(f"sandbox {sandbox_id} is {rec.state.value}")
            await self.store.update(sandbox_id, end_at=max(rec.end_at, time.time() + duration))

    async def connect(
        self, sandbox_id: str, seconds: int | None, *, memory: bool | None = None
    ) -> tuple[SandboxRecord, bool]:
        """Make sure the sandbox runs; returns it and whether it had to be resumed.

        ``memory=False`` resumes a paused sandbox by a cold boot from its disk, its saved
        memory dropped, and means nothing for a running one (E2B's connect)."""
        async with self._locked(sandbox_id):
            rec = await self.get(sandbox_id)
            if rec.state is SandboxState.RUNNING:
                if seconds is not None:
                    # Connecting only ever extends a running sandbox's life.
                    end_at = max(rec.end_at, time.time() + seconds)
                    await self.store.update(sandbox_id, end_at=end_at)
                return await self.get(sandbox_id), False
            if rec.state is SandboxState.PAUSED:
                await self._resume_locked(rec, seconds, memory=memory is not False)
                return await self.get(sandbox_id), True
            raise Conflict(f"sandbox {sandbox_id} is {rec.state.value}")

    async def resume(
        self,
        sandbox_id: str,
        seconds: int | None,
        *,
        auto_pause: bool | None = None,
        memory: bool | None = None,
    ) -> SandboxRecord:
        """Resume a paused sandbox; ``auto_pause`` replaces its auto-pause setting."""
        async with self._locked(sandbox_id):
            rec = await self.get(sandbox_id)
            if rec.state is not SandboxState.PAUSED:
                raise Conflict(f"sandbox {sandbox_id} is {rec.state.value}, not paused")
            await self._resume_locked(rec, seconds, memory=memory is not False)
            if auto_pause is not None:
                await self.store.update(sandbox_id, auto_pause=auto_pause)
        return await self.get(sandbox_id)

    async def _resume_locked(
        self, rec: SandboxRecord, seconds: int | None, *, memory: bool = True
    ) -> None:
        if BUILD_METADATA in rec.metadata:
            moved = await self.store.transition(
                rec.id, SandboxState.PAUSED, SandboxState.RESUMING, **self._stamp
            )
        else:
            # A resumed sandbox takes a place again: held from the check until it has.
            async with self.limits.reserve(rec.team_id, create=False):
                moved = await self.store.transition(
                    rec.id, SandboxState.PAUSED, SandboxState.RESUMING, **self._stamp
                )
        if not moved:
            raise Conflict(f"sandbox {rec.id} changed state during resume")
        started = time.monotonic()
        rid = rec.id
        try:
            # The node re-inits envd (clock, entropy; a guest booted from its disk gets the
            # full `/init` of a create) and pauses it again if that fails.
            spec = self._spec(rec)
            placement = await (
                self.runtime.resume(spec) if memory else self.runtime.resume(spec, memory=False)
            )
        except BaseException as exc:
            if isinstance(exc, Lost):
                # The guest ran again and failed: nothing paused is left to go back to.
                await self.store.transition(rec.id, SandboxState.RESUMING, SandboxState.GONE)
                await self.store.log(rec.id, f"{LOST}{exc}", "error")
                await self._released(rec.id)
                raise SandboxLost(rec.id, str(exc)) from exc
            # A resume without memory may have dropped it before it failed.
            found = await self.runtime.find(rid)
            mode = rec.pause_mode
            if found is not None and found.state == "paused":
                mode = _pause_mode(found.memory)
            await self.store.transition(
                rec.id, SandboxState.RESUMING, SandboxState.PAUSED, pause_mode=mode
            )
            raise_failure(exc, f"sandbox {rec.id} was not resumed")
        await self.store.transition(
            rec.id,
            SandboxState.RESUMING,
            SandboxState.RUNNING,
            address=placement.address,
            node_id=placement.node_id,
            envd_url=placement.envd_url,
            end_at=time.time() + (seconds if seconds is not None else DEFAULT_TIMEOUT_S),
            pause_mode=None,
            note="resumed by a boot from its disk" if placement.booted else "resumed",
        )
        self.metrics.resume_seconds.observe(time.monotonic() - started)
        self._wake.set()

    async def pause(
        self,
        sandbox_id: str,
        *,
        require_healthy_guest: bool = False,
        memory: bool = True,
        strict: bool = True,
    ) -> None:
        """Pause a running sandbox. ``require_healthy_guest``: refuse (503, it keeps running)
        while its envd does not answer, instead of saving a guest that may be stuck.
        ``memory=False``: keep only its disk (E2B's filesystem-only pause; the resume boots
        it), which always needs envd to flush the disk; ``strict=False`` (an auto-pause)
        pauses anyway, with what the disk holds, rather than refuse."""
        async with self._locked(sandbox_id):
            rec = await self.get(sandbox_id)
            if rec.state is SandboxState.PAUSED:
                raise Conflict(f"sandbox {sandbox_id} is already paused")
            check = require_healthy_guest or (not memory and strict)
            if check and rec.state is SandboxState.RUNNING:
                why = await self._envd_unhealthy(rec)
                if why is not None:
                    raise Unavailable(
                        f"sandbox {sandbox_id} was not paused: its guest agent (envd) does not "
                        f"answer ({why}); it keeps running"
                    )
            if not await self.store.transition(
                sandbox_id, SandboxState.RUNNING, SandboxState.PAUSING, **self._stamp
            ):
                raise Conflict(f"sandbox {sandbox_id} is {rec.state.value}")
            # Tests of a replica dying mid-pause: the row says pausing, the node was not asked.
            crash_point("control:pausing")
            try:
                rid = rec.id
                if memory:
                    await self.runtime.pause(rid)
                else:
                    await self.runtime.pause(
                        rid, memory=False, envd_token=rec.envd_token, strict=strict
                    )
            except BaseException as exc:
                await self.store.transition(sandbox_id, SandboxState.PAUSING, SandboxState.RUNNING)
                raise_failure(exc, f"sandbox {sandbox_id} was not paused")
            # A paused sandbox's timeout stops (a resume starts a new one), and its retention
            # counts from now, not from a deadline it never reached.
            await self.store.transition(
                sandbox_id,
                SandboxState.PAUSING,
                SandboxState.PAUSED,
                address=None,
                end_at=min(rec.end_at, time.time()),
                pause_mode=_pause_mode(memory),
                note="paused" if memory else "paused (filesystem only)",
            )
            await self._released(sandbox_id)
