"""Reset in place: a running sandbox goes back to the state it was created from (or to a named
snapshot) and keeps its id, URL, tokens, metadata, env vars and timeout.

The guest is swapped, not rebooted: the node kills the sandbox's QEMU and restores the saved
state into a new one under the same id, in the same network slot and workdir (`runtime.reset`,
`node.host_reset`; its memory mapped copy-on-write), so the proxy keeps routing by id. A
runtime that cannot (a cluster's node agents: `Unsupported`) gets a delete and a create under
the same id instead. What was in flight ends first: the proxy's open requests and
WebSockets to the sandbox are cut (a client's command stream ends with an error), then the
old VM goes. The row is `resuming` meanwhile, with the reference it starts from (`reset_to`):
a server that dies mid-reset finishes it (`_finish_reset`): the sandbox the node still runs is
kept as it is (the old guest, or the reset one), and one the node no longer runs is started
from that reference, so a crash leaves the old state or the reset one, never a lost sandbox
that a start could have saved."""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import replace

from agentenv.contract.errors import Conflict, CreateFailed, TemplateNotFound
from agentenv.contract.runtime import (
    Found,
    Lost,
    Placement,
    TagUnavailable,
    TemplateUnavailable,
    Unsupported,
)
from agentenv.control.sandbox_base import LOST, SandboxBase
from agentenv.control.store import SandboxRecord, SandboxState
from agentenv.faults import crash_point

log = logging.getLogger("agentenv.sandboxes")


class SandboxReset(SandboxBase):
    """`reset` of the sandbox manager."""

    async def reset(self, sandbox_id: str, snapshot: str | None = None) -> SandboxRecord:
        """Put the running sandbox back to its template's saved state (or `snapshot`'s)."""
        async with self._locked(sandbox_id):
            rec = await self.get(sandbox_id)
            if rec.state is not SandboxState.RUNNING:
                raise Conflict(f"sandbox {sandbox_id} is {rec.state.value}, not running")
            # A fork's child goes back to its fork's capture: the state it was created from.
            ref = target = snapshot or rec.origin or rec.template
            if ref != rec.origin:
                target = await self._reset_target(rec, ref)
            if not await self.store.transition(
                sandbox_id,
                SandboxState.RUNNING,
                SandboxState.RESUMING,
                reset_to=target,
                **self._stamp,
            ):
                raise Conflict(f"sandbox {sandbox_id} changed state during reset")
            started = time.monotonic()
            # In-flight commands and WebSockets end now, before their VM goes.
            await self._released(sandbox_id, f"sandbox {sandbox_id} was reset")
            try:
                placement = await self.runtime.reset(replace(self._spec(rec), template=target))
            except Unsupported:
                placement = None
            except Lost as exc:
                await self._reset_failed(rec, ref, exc)
                raise
            except Exception as exc:
                # Refused before the old guest was touched (a bad target, no capacity, a
                # full disk): the sandbox runs on as it was, and the caller gets the reason.
                await self._reset_refused(rec, ref, exc)
                if isinstance(exc, TemplateUnavailable):
                    raise self._target_gone(rec, ref, exc) from exc
                raise
            except BaseException as exc:
                # A cancel: where the node was in the swap is unknown, so nothing is kept.
                await self._reset_failed(rec, ref, exc)
                raise
            if placement is not None:
                await self._reset_done(rec, placement, ref, started)
                return await self.get(sandbox_id)
            # A runtime that cannot reset in place (a cluster's node agents): the sandbox's
            # guest is replaced by a delete and a create under the same id.
            try:
                await self.runtime.delete(sandbox_id)
                crash_point("reset:deleted")
            except BaseException as exc:
                await self._reset_failed(rec, ref, exc)
                raise
            await self._start_reset(rec, target, ref, started)
        return await self.get(sandbox_id)

    async def _reset_target(self, rec: SandboxRecord, ref: str) -> str:
        """The reference a reset to template or snapshot `ref` hands the runtime, once it
        is known to be the sandbox's machine."""
        try:
            tpl = await self.templates.get(ref)
        except TemplateUnavailable as exc:
            tag = str(exc) if isinstance(exc, TagUnavailable) else None
            raise TemplateNotFound(ref, tag) from exc
        if (tpl.memory_mb or rec.memory_mb) != rec.memory_mb or (tpl.cpu or rec.cpu) != rec.cpu:
            raise Conflict(
                f"{ref!r} is a {tpl.cpu} vCPU / {tpl.memory_mb} MB machine; sandbox "
                f"{rec.id} is {rec.cpu} / {rec.memory_mb}: a reset keeps the machine"
            )
        return tpl.ref or ref

    @staticmethod
    def _target_gone(rec: SandboxRecord, ref: str, exc: TemplateUnavailable) -> Exception:
        """The runtime no longer has the reset's target (deleted meanwhile; a fork's capture
        not on the node the sandbox now runs on)."""
        if ref == rec.origin:
            return Conflict(
                f"sandbox {rec.id} was forked from a capture ({ref[:12]}) its node no longer "
                "holds; reset it to a template or snapshot by name"
            )
        if isinstance(exc, TagUnavailable):
            return TemplateNotFound(ref, str(exc))
        return TemplateNotFound(ref, f"template {ref!r} is not available here: {exc}")

    async def _start_reset(self, rec: SandboxRecord, target: str, ref: str, started: float) -> None:
        """Start the `resuming` row's sandbox from `target` and mark it running; its deadline
        stays. A failure leaves it lost, with the reason."""
        try:
            placement = await self.runtime.create(replace(self._spec(rec), template=target))
        except BaseException as exc:
            await self._reset_failed(rec, ref, exc)
            raise
        await self._reset_done(rec, placement, ref, started)

    async def _reset_done(
        self, rec: SandboxRecord, placement: Placement, ref: str, started: float
    ) -> None:
        # Its timeout stays: the episode's deadline did not move.
        await self.store.transition(
            rec.id,
            SandboxState.RESUMING,
            SandboxState.RUNNING,
            address=placement.address,
            node_id=placement.node_id,
            envd_url=placement.envd_url,
            reset_to=None,
        )
        await self.store.log(rec.id, f"reset to {ref!r} in {time.monotonic() - started:.2f}s")

    async def _reset_refused(self, rec: SandboxRecord, ref: str, exc: Exception) -> None:
        """The runtime refused the reset with the sandbox untouched: back to running, its
        placement and deadline as they were."""
        await self.store.transition(
            rec.id, SandboxState.RESUMING, SandboxState.RUNNING, reset_to=None
        )
        await self.store.log(rec.id, f"reset to {ref!r} refused: {exc}", "error")

    async def _reset_failed(self, rec: SandboxRecord, ref: str, exc: BaseException) -> None:
        """The old guest is gone (or going) and no new one runs: the sandbox is lost, and says
        why (and whatever is left of either VM goes with it). An `Exception` is raised again
        as `CreateFailed`; a cancel by the caller."""
        why = f"reset to {ref!r} failed: {exc}"
        with contextlib.suppress(Exception):
            await self.runtime.delete(rec.id)
        await self.store.transition(rec.id, SandboxState.RESUMING, SandboxState.GONE)
        await self.store.log(rec.id, LOST + why, "error")
        log.error("sandbox %s %s", rec.id, why, extra={"sandbox_id": rec.id})
        if isinstance(exc, Exception):
            raise CreateFailed(f"sandbox {rec.id}: {why}") from exc

    async def _finish_reset(self, rec: SandboxRecord, found: Found | None) -> str | None:
        """Recovery of a reset cut short (the row `resuming` with `reset_to`): a sandbox the
        runtime runs is kept as found (the old guest if the cut came before its delete, else
        the reset one), its deadline unchanged; one it does not hold is started from
        `reset_to` now. Returns the id while the sandbox exists (None once lost)."""
        target = rec.reset_to or rec.template
        if found is not None and found.state == "running" and found.placement is not None:
            await self.store.transition(
                rec.id,
                SandboxState.RESUMING,
                SandboxState.RUNNING,
                address=found.placement.address,
                node_id=found.placement.node_id,
                envd_url=found.placement.envd_url,
                reset_to=None,
            )
            await self.store.log(rec.id, f"a reset to {target!r} was cut short; running as found")
            return rec.id
        if found is not None:
            with contextlib.suppress(Exception):
                await self.runtime.delete(rec.id)
        try:
            await self._start_reset(rec, target, target, time.monotonic())
        except Exception as exc:
            log.error("sandbox %s: finishing its reset failed: %r", rec.id, exc)
            return None
        await self.store.log(rec.id, "the reset was cut short by a restart and finished")
        return rec.id
