"""Reset in place: a running sandbox goes back to the state it was created from (or to a named
snapshot) and keeps its id, URL, tokens, metadata, env vars and timeout.

The guest is swapped, not rebooted: the node deletes the sandbox's VM and starts the saved state
again under the same id (create = resume of a snapshot, its memory mapped copy-on-write), so
the proxy keeps routing by id. What was in flight ends first: the proxy's open requests and
WebSockets to the sandbox are cut (a client's command stream ends with an error), then the
old VM goes. The row is `resuming` meanwhile; a server that dies mid-reset finds it there, and
its recovery settles it by what the node holds (running, or lost)."""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import replace

from agentenv.contract.errors import Conflict, CreateFailed, TemplateNotFound
from agentenv.contract.runtime import TagUnavailable, TemplateUnavailable
from agentenv.control.sandbox_base import LOST, SandboxBase
from agentenv.control.store import SandboxRecord, SandboxState

log = logging.getLogger("agentenv.sandboxes")


class SandboxReset(SandboxBase):
    """`reset` of the sandbox manager."""

    async def reset(self, sandbox_id: str, snapshot: str | None = None) -> SandboxRecord:
        """Put the running sandbox back to its template's saved state (or `snapshot`'s)."""
        async with self._locked(sandbox_id):
            rec = await self.get(sandbox_id)
            if rec.state is not SandboxState.RUNNING:
                raise Conflict(f"sandbox {sandbox_id} is {rec.state.value}, not running")
            ref = snapshot or rec.template
            try:
                tpl = await self.templates.get(ref)
            except TemplateUnavailable as exc:
                tag = str(exc) if isinstance(exc, TagUnavailable) else None
                raise TemplateNotFound(ref, tag) from exc
            if (tpl.memory_mb or rec.memory_mb) != rec.memory_mb or (tpl.cpu or rec.cpu) != rec.cpu:
                raise Conflict(
                    f"{ref!r} is a {tpl.cpu} vCPU / {tpl.memory_mb} MB machine; sandbox "
                    f"{sandbox_id} is {rec.cpu} / {rec.memory_mb}: a reset keeps the machine"
                )
            if not await self.store.transition(
                sandbox_id, SandboxState.RUNNING, SandboxState.RESUMING, **self._stamp
            ):
                raise Conflict(f"sandbox {sandbox_id} changed state during reset")
            started = time.monotonic()
            # In-flight commands and WebSockets end now, before their VM goes.
            await self._released(sandbox_id)
            try:
                await self.runtime.delete(sandbox_id)
                placement = await self.runtime.create(
                    replace(self._spec(rec), template=tpl.ref or ref)
                )
            except BaseException as exc:
                # The old guest is gone and no new one runs: the sandbox is lost, and says why
                # (and whatever is left of either VM goes with it).
                why = f"reset to {ref!r} failed: {exc}"
                with contextlib.suppress(Exception):
                    await self.runtime.delete(sandbox_id)
                await self.store.transition(sandbox_id, SandboxState.RESUMING, SandboxState.GONE)
                await self.store.log(sandbox_id, LOST + why, "error")
                log.error("sandbox %s %s", sandbox_id, why, extra={"sandbox_id": sandbox_id})
                if isinstance(exc, Exception):
                    raise CreateFailed(f"sandbox {sandbox_id}: {why}") from exc
                raise
            # Its timeout stays: the episode's deadline did not move.
            await self.store.transition(
                sandbox_id,
                SandboxState.RESUMING,
                SandboxState.RUNNING,
                address=placement.address,
                node_id=placement.node_id,
                envd_url=placement.envd_url,
            )
            await self.store.log(
                sandbox_id, f"reset to {ref!r} in {time.monotonic() - started:.2f}s"
            )
        return await self.get(sandbox_id)
