"""Placing a new sandbox (`ClusterPlacement.create`): best of K ready nodes sampled, by free
memory, CPUs and slots, warm template first; the binding written before the node is asked;
a refusing node skipped. When no node has room, a create that may wait goes to the best node
anyway and queues there for capacity. Split from `runtime.py`."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

from agentenv.cluster.membership import NodeInfo
from agentenv.cluster.routing import NO_NODE_RETRY_S, VMM_OVERHEAD_MB, ClusterRouting
from agentenv.contract.errors import BadRequest, Unavailable
from agentenv.contract.runtime import Placement, SandboxSpec
from agentenv.noderpc.client import RemoteRuntime
from agentenv.noderpc.errors import NodeUnreachable


@dataclass
class _Candidate:
    info: NodeInfo
    warm: bool
    # Creates this replica has in flight there (not yet in the node's published load).
    inflight_mb: int


def _fits(c: _Candidate, need_mb: int) -> bool:
    return c.info.load.free_slots > 0 and c.info.load.free_memory_mb - c.inflight_mb >= need_mb


def _score(c: _Candidate) -> tuple[bool, float]:
    """Warm first; then the larger share of the node left free (memory, CPUs, slots)."""
    info = c.info
    mem = (info.load.free_memory_mb - c.inflight_mb) / max(1, info.capacity.memory_mb)
    cpu = max(0, info.capacity.cpus - info.load.running) / max(1, info.capacity.cpus)
    slots = info.load.free_slots / max(1, info.capacity.slots)
    return c.warm, mem + 0.5 * cpu + 0.25 * min(1.0, slots)


class ClusterPlacement(ClusterRouting):
    """Placement of the cluster runtime."""

    async def _candidates(self, spec: SandboxSpec, template: str) -> list[NodeInfo]:
        nodes = [n for n in await self.membership.list_nodes() if n.ready]
        if not nodes:
            raise Unavailable("no node can take a sandbox: no ready node", NO_NODE_RETRY_S)
        catalog_holders = set(await self.catalog.holders(template)) if template else set()
        # Nodes with the template's snapshot (or the snapshot itself) on disk: a restore from
        # their page cache, no fetch from object storage. Where they only order the nodes (any
        # node fetches a snapshot from object storage; a catalog template is no snapshot),
        # the mirror's "none" stands and no etcd read is made.
        orders_only = self.settings.object_store is not None or bool(catalog_holders)
        snapshot_holders = set(
            await self.locations.holders("snapshot", template, preference=orders_only)
        )
        warm = set(await self.locations.holders("template", template, preference=True))
        warm |= snapshot_holders
        need = spec.memory_mb + VMM_OVERHEAD_MB
        cands = [_Candidate(n, n.node_id in warm, self._pending_mb(n)) for n in nodes]
        if snapshot_holders and self.settings.object_store is None:
            # Without object storage a snapshot can only be created from where it was taken.
            cands = [c for c in cands if c.info.node_id in snapshot_holders]
        if catalog_holders:
            # A catalog template (its layers) is only where a node has it: the bucket holds
            # snapshots, not catalogs (an image imported on one node, `docker` built on some).
            cands = [c for c in cands if c.info.node_id in catalog_holders]
            if not cands:
                raise Unavailable(
                    f"no ready node has template {template!r} (it is on "
                    f"{', '.join(sorted(catalog_holders))})",
                    NO_NODE_RETRY_S,
                )
        fits = [c for c in cands if _fits(c, need)]
        if not fits and spec.capacity_wait_s != 0 and cands:
            # No node has room now, and the create may wait: it queues on the node likely to
            # free room first, in that node's capacity queue (arrival order, bounded by the
            # create's wait, or the node's default), instead of a 503 here at once. One node
            # only: a second would wait as long again.
            return [max(cands, key=_score).info]
        if not fits:
            detail = ", ".join(
                f"{c.info.node_id}: {c.info.load.free_memory_mb - c.inflight_mb} MiB, "
                f"{c.info.load.free_slots} slots free"
                for c in cands
            )
            raise Unavailable(
                f"no node can take a sandbox of {spec.memory_mb} MB ({detail})", NO_NODE_RETRY_S
            )
        sampled = self._rng.sample(fits, min(self.sample_k, len(fits)))
        # Warm nodes join the sample: a restore from a cached snapshot beats a cold fetch.
        sampled += [c for c in fits if c.warm and c not in sampled][: self.sample_k]
        best = sorted(sampled, key=_score, reverse=True)
        rest = sorted((c for c in fits if c not in best), key=_score, reverse=True)
        return [c.info for c in best + rest]

    def _pending_mb(self, info: NodeInfo) -> int:
        """What this replica has sent to the node that its published load does not count
        yet: creates in flight, and those done since the node last measured its load."""
        seen = info.load.updated_at
        recent = [(t, mb) for t, mb in self._placed.get(info.node_id, []) if t > seen]
        self._placed[info.node_id] = recent
        return self._inflight_mb.get(info.node_id, 0) + sum(mb for _, mb in recent)

    async def reset(self, spec: SandboxSpec) -> Placement:
        """In place on the node the sandbox runs on: a reset keeps it where it is."""
        node_id, client = await self._route(spec.sandbox_id)
        placement = await client.reset(spec)
        return replace(placement, node_id=node_id)

    async def create_many(self, specs: Sequence[SandboxSpec]) -> list[Placement | BaseException]:
        # One create each (the node's batch start is for its own in-process runtime).
        return list(await asyncio.gather(*map(self.create, specs), return_exceptions=True))

    async def create(self, spec: SandboxSpec) -> Placement:
        candidates = await self._candidates(spec, spec.template)
        refusals: list[str] = []
        retry: list[int] = []
        need = spec.memory_mb + VMM_OVERHEAD_MB
        for info in candidates:
            # Counted before the first await: concurrent creates placed after this one see it.
            self._inflight_mb[info.node_id] = self._inflight_mb.get(info.node_id, 0) + need
            client: RemoteRuntime | None = None
            try:
                if not await self.bindings.create(spec.sandbox_id, info.node_id):
                    raise BadRequest(f"sandbox id {spec.sandbox_id} is already bound to a node")
                client = await self._client_for(info)
                placement = await client.create(spec)
            except Unavailable as exc:
                # Refused (503: nothing was made) or unreachable (it may have been made).
                if isinstance(exc, NodeUnreachable) and client is not None:
                    with contextlib.suppress(Exception):
                        await client.delete(spec.sandbox_id)
                await asyncio.shield(self.bindings.delete(spec.sandbox_id, info.node_id))
                refusals.append(f"{info.node_id}: {exc}")
                if exc.retry_after:
                    retry.append(exc.retry_after)
                continue
            except BaseException:
                await asyncio.shield(self.bindings.delete(spec.sandbox_id, info.node_id))
                raise
            finally:
                self._inflight_mb[info.node_id] -= need
            self._bound[spec.sandbox_id] = info.node_id
            self._placed.setdefault(info.node_id, []).append((time.time(), need))
            return replace(placement, node_id=info.node_id)
        raise Unavailable(
            "no node could take the sandbox: " + "; ".join(refusals),
            min(retry) if retry else NO_NODE_RETRY_S,
        )
