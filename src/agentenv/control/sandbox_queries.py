"""Reads over the sandboxes that change nothing: guest and host metrics, state counts for the
metrics route, the snapshot list. Split from `sandboxes.py`."""

from __future__ import annotations

import asyncio
from typing import Any

from agentenv.contract.runtime import HostMemory, SnapshotInfo
from agentenv.control.sandbox_base import SandboxBase
from agentenv.control.store import SandboxRecord, SandboxState


class SandboxQueries(SandboxBase):
    """Listing and metrics of the sandbox manager."""

    async def guest_metrics(self, rec: SandboxRecord) -> dict[str, Any] | None:
        """envd's current `/metrics` sample, or None when the guest cannot say."""
        if rec.state is not SandboxState.RUNNING:
            return None
        return await self.runtime.guest_metrics(rec.id, rec.envd_token)

    def note_activity(self, rec: SandboxRecord) -> None:
        """The proxy passed traffic to this sandbox (it is not idle, and its client is
        there)."""
        self.runtime.note_activity(rec.id)
        self.touch(rec)

    async def host_memory(self, rec: SandboxRecord) -> HostMemory | None:
        if rec.state is not SandboxState.RUNNING:
            return None
        return await self.runtime.host_memory(rec.id)

    async def host_memories(self, recs: list[SandboxRecord]) -> list[HostMemory | None]:
        """`host_memory` of each, asked concurrently (a list of many sandboxes on nodes)."""
        return list(await asyncio.gather(*(self.host_memory(r) for r in recs)))

    async def host_memory_all(self) -> dict[str, HostMemory]:
        """Host memory of every running sandbox, by sandbox id; also kept as
        `host_memory_seen` for the Prometheus collector, which cannot await."""
        recs = await self.store.select([SandboxState.RUNNING])
        mems = await self.host_memories(recs)
        out = {r.id: m for r, m in zip(recs, mems, strict=True) if m is not None}
        self.host_memory_seen = out
        return out

    async def state_counts(self) -> tuple[dict[str, int], int]:
        """Users' sandboxes by state and the build sandboxes holding a VM, from the store;
        also kept as `state_counts_seen` / `builds_seen` for the Prometheus collector."""
        counts = await self.store.count_by_state()
        builds = await self.store.count_builds()
        self.state_counts_seen, self.builds_seen = counts, builds
        return counts, builds

    async def snapshots(self) -> list[SnapshotInfo]:
        return await self.runtime.snapshots()
