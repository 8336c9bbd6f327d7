"""The control plane's `Runtime` over a cluster of node agents.

Every call is routed by the sandbox's binding (`bindings`, sandbox id -> node id, in etcd) to
that node's agent over the node RPC (`noderpc.RemoteRuntime`). A create first places the
sandbox: best of K nodes sampled among the ready ones (alive, not cordoned, room for it), by
free memory, free CPUs and slots, preferring a node that already holds the template's snapshot
(`locations`: its page cache is warm). The binding is written before the node is asked, so a
crash in between leaves a binding someone can see and clean; a node that refuses (its own
admission control, 503) is skipped for the next candidate, and only when every candidate
refuses does the caller get 503 with a retry hint.

Replicas keep nothing of their own here: every decision reads etcd (the member list with each
node's published load, the bindings), so any replica can serve any request. What a replica
does cache (a binding, for `note_activity`, which must never wait) is only a hint.

A node that leaves the cluster (its lease lapsed, or it stopped) takes its running sandboxes
with it: they are reported lost through `watch_lost` with the reason. Paused ones keep their
binding and come back when the node does. A node that joins again may still hold sandboxes
nobody is bound to any more (killed while it was away): they are deleted there.

A node can also lose a sandbox without leaving: its agent restarts within its lease, and the
VM had died meanwhile, so the lost event went to nobody. Reconciliation finds those: when a
node joins (again) and every `node_reconcile_s`, each live node's bindings are compared with
what it holds (`reconcile`).

The parts: `routing` (state, clients, per-call routing), `placement` (create),
`reconcile` (membership and reconciliation); this module holds the rest of the contract,
start/close and the `NodeDirectory` (cordon, drain).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from agentenv.cluster.membership import NodeInfo
from agentenv.cluster.placement import ClusterPlacement
from agentenv.cluster.reconcile import ClusterReconcile
from agentenv.cluster.routing import GATEWAY_FRESH_S, NO_NODE_RETRY_S, NodeDown, log
from agentenv.contract.egress import Egress
from agentenv.contract.errors import BadRequest, Unavailable
from agentenv.contract.nodes import NodeDirectory, NodeStatus, UnknownNode
from agentenv.contract.runtime import (
    SNAPSHOT_ID,
    Found,
    GuestCommand,
    HostMemory,
    ImportEvent,
    Placement,
    Runtime,
    SandboxSpec,
    SnapshotInfo,
    TemplateInfo,
)
from agentenv.noderpc.errors import NodeUnreachable


class ClusterRuntime(ClusterPlacement, ClusterReconcile):
    """`Runtime` and `NodeDirectory` of a control-plane replica."""

    async def start(self) -> None:
        for mirror in self.mirrors:
            mirror.start()
        for info in await self.membership.list_nodes():
            await self._client_for(info)
            self._live.add(info.node_id)
        self._watch_task = asyncio.create_task(self._watch_nodes(), name="cluster-node-watch")
        self._reconcile_task = asyncio.create_task(
            self._reconcile_forever(), name="cluster-reconcile"
        )

    async def close(self) -> None:
        for task in (self._watch_task, self._reconcile_task):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        self._watch_task = self._reconcile_task = None
        for mirror in self.mirrors:
            await mirror.stop()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for client in self._clients.values():
            with contextlib.suppress(Exception):
                await client.close()
        self._clients.clear()
        await self.etcd.close()

    async def update_egress(self, sandbox_id: str, egress: Egress) -> None:
        _, client = await self._route(sandbox_id)
        await client.update_egress(sandbox_id, egress)

    async def delete(self, sandbox_id: str) -> None:
        node_id = await self._node_of(sandbox_id)
        if node_id is None:
            return
        try:
            _, client = await self._route(sandbox_id, node_id)
        except NodeDown:
            # Gone with its node; if the node comes back, it deletes what nobody is bound to.
            client = None
        if client is not None:
            await client.delete(sandbox_id)
        await self.bindings.delete(sandbox_id, node_id)
        self._bound.pop(sandbox_id, None)

    async def pause(
        self,
        sandbox_id: str,
        *,
        memory: bool = True,
        envd_token: str | None = None,
        strict: bool = True,
    ) -> None:
        _, client = await self._route(sandbox_id)
        await client.pause(sandbox_id, memory=memory, envd_token=envd_token, strict=strict)

    async def resume(self, spec: SandboxSpec, *, memory: bool = True) -> Placement:
        """On the node that holds it while that node is ready; else (cordoned, drained, or
        gone) on another one, which fetches the paused sandbox from object storage first. The
        binding moves before the new node is asked and moves back if it cannot take it."""
        rid = spec.sandbox_id
        node_id = await self._node_of(rid)
        if node_id is None:
            raise Unavailable(f"sandbox {rid} is bound to no node", NO_NODE_RETRY_S)
        home = await self.membership.get_node(node_id)
        if home is not None and (home.ready or self.settings.object_store is None):
            # Without object storage its files can only resume where they are.
            home_id, client = await self._route(rid, node_id)
            return replace(await client.resume(spec, memory=memory), node_id=home_id)
        if self.settings.object_store is None:
            raise NodeDown(
                f"sandbox {rid} is paused on node {node_id}, which is not a member of the "
                "cluster now; without object storage it resumes only there",
                NO_NODE_RETRY_S,
            )
        candidates = [
            c for c in await self._candidates(spec, spec.template) if c.node_id != node_id
        ]
        refusals: list[str] = []
        for info in candidates:
            if not await self.bindings.move(rid, node_id, info.node_id):
                raise Unavailable(f"sandbox {rid} moved meanwhile; try again", 1)
            try:
                client = await self._client_for(info)
                placement = await client.resume(spec, memory=memory)
            except Unavailable as exc:
                await asyncio.shield(self.bindings.move(rid, info.node_id, node_id))
                refusals.append(f"{info.node_id}: {exc}")
                continue
            except BaseException:
                await asyncio.shield(self.bindings.move(rid, info.node_id, node_id))
                raise
            self._bound[rid] = info.node_id
            log.info("sandbox %s resumed on %s (was paused on %s)", rid, info.node_id, node_id)
            if home is not None:
                # The old copy goes before the caller hears of the new one (a node that is
                # away drops it when it joins again).
                await self._forget_on(node_id, rid)
            return replace(placement, node_id=info.node_id)
        raise Unavailable(
            f"sandbox {rid} could not be resumed on another node: " + "; ".join(refusals),
            NO_NODE_RETRY_S,
        )

    async def forget(self, sandbox_id: str) -> None:
        _, client = await self._route(sandbox_id)
        await client.forget(sandbox_id)

    async def init_guest(self, spec: SandboxSpec) -> None:
        _, client = await self._route(spec.sandbox_id)
        await client.init_guest(spec)

    async def guest_metrics(self, sandbox_id: str, envd_token: str | None) -> dict[str, Any] | None:
        try:
            _, client = await self._route(sandbox_id)
        except Unavailable:
            return None
        return await client.guest_metrics(sandbox_id, envd_token)

    async def guest_health(self, sandbox_id: str) -> str | None:
        try:
            _, client = await self._route(sandbox_id)
        except Unavailable as exc:
            return str(exc)
        try:
            return await client.guest_health(sandbox_id)
        except NodeUnreachable as exc:
            return str(exc)

    async def guest_run(
        self,
        sandbox_id: str,
        envd_token: str | None,
        command: GuestCommand,
        on_line: Callable[[str, str], None],
    ) -> int:
        _, client = await self._route(sandbox_id)
        return await client.guest_run(sandbox_id, envd_token, command, on_line)

    async def guest_write(
        self, sandbox_id: str, envd_token: str | None, path: str, data: bytes, *, append: bool
    ) -> None:
        _, client = await self._route(sandbox_id)
        await client.guest_write(sandbox_id, envd_token, path, data, append=append)

    async def guest_defaults(
        self, sandbox_id: str, envd_token: str | None, user: str, workdir: str
    ) -> None:
        _, client = await self._route(sandbox_id)
        await client.guest_defaults(sandbox_id, envd_token, user, workdir)

    async def is_alive(self, sandbox_id: str) -> bool:
        try:
            _, client = await self._route(sandbox_id)
        except Unavailable:
            return False
        return await client.is_alive(sandbox_id)

    async def find(self, sandbox_id: str) -> Found | None:
        try:
            node_id, client = await self._route(sandbox_id)
        except Unavailable:
            return None
        found = await client.find(sandbox_id)
        if found is None or found.placement is None:
            return found
        return replace(found, placement=replace(found.placement, node_id=node_id))

    async def sandbox_ids(self) -> list[str]:
        lists, _ = await self._ask_live("list its sandboxes", lambda c: c.sandbox_ids())
        return sorted({rid for got in lists for rid in got})

    async def lost_reason(self, sandbox_id: str) -> str | None:
        node_id = await self.bindings.get(sandbox_id)
        if node_id is None:
            return None
        try:
            _, client = await self._route(sandbox_id)
        except NodeDown as exc:
            return str(exc)
        return await client.lost_reason(sandbox_id)

    def watch_lost(self, handler: Callable[[str, str], None]) -> None:
        self._handlers.append(handler)

    async def snapshot(
        self, sandbox_id: str, name: str | None, envd_token: str | None, *, memory: bool = True
    ) -> SnapshotInfo:
        _, client = await self._route(sandbox_id)
        return await client.snapshot(sandbox_id, name, envd_token, memory=memory)

    async def fork(
        self, sandbox_id: str, children: list[SandboxSpec], envd_token: str | None
    ) -> list[Placement]:
        """On the node that holds the source, running or paused (that node fetches a paused
        one from object storage if its files are not there). A source whose node is gone is
        not forked elsewhere: a resume moves a paused one to another node first."""
        try:
            node_id, client = await self._route(sandbox_id)
        except NodeDown as exc:
            raise NodeDown(
                f"{exc.message}; a fork runs where its source is: resume the sandbox (which "
                "moves a paused one to another node) and fork it there",
                NO_NODE_RETRY_S,
            ) from exc
        bound: list[str] = []
        try:
            for child in children:
                if not await self.bindings.create(child.sandbox_id, node_id):
                    raise BadRequest(f"sandbox id {child.sandbox_id} is already bound to a node")
                bound.append(child.sandbox_id)
            placements = await client.fork(sandbox_id, children, envd_token)
        except BaseException:
            for rid in bound:
                with contextlib.suppress(Exception):
                    await asyncio.shield(self.bindings.delete(rid, node_id))
            raise
        for rid in bound:
            self._bound[rid] = node_id
        return [replace(p, node_id=node_id) for p in placements]

    async def gateway(self, node_id: str) -> str | None:
        """From the node's record as this replica last saw it (no etcd read per request),
        read again when older than `GATEWAY_FRESH_S`: an agent that restarted within its
        lease may listen on another port before its rejoin reaches this replica."""
        seen = self._gateways.get(node_id)
        if seen is None or time.monotonic() - seen[1] > GATEWAY_FRESH_S:
            info = await self.membership.get_node(node_id)
            if info is None:
                self._gateways.pop(node_id, None)
                return None
            seen = self._gateways[node_id] = (info.gateway, time.monotonic())
        return seen[0] or None

    async def snapshots(self) -> list[SnapshotInfo]:
        lists, _ = await self._ask_live("list its snapshots", lambda c: c.snapshots())
        seen: dict[str, SnapshotInfo] = {}
        for got in lists:
            for snap in got:
                seen.setdefault(snap.snapshot_id, snap)
        return list(seen.values())

    async def import_image(
        self,
        ref: str,
        name: str,
        credentials: tuple[str, str] | None,
        on_event: Callable[[ImportEvent], None],
    ) -> TemplateInfo:
        """On one node: one that has the template already (a re-import is quick), else the
        ready node with the most free memory (the build sandbox runs there next). The node
        publishes the template in its catalog before it answers, so creates from it are
        placed there."""
        holders = set(await self.catalog.holders(name))
        nodes = [n for n in await self.membership.list_nodes() if n.ready]
        if not nodes:
            raise Unavailable("no node can import an image: no ready node", NO_NODE_RETRY_S)
        best = max(
            nodes,
            key=lambda n: (n.node_id in holders, n.load.free_memory_mb - self._pending_mb(n)),
        )
        client = await self._client_for(best)
        log.info("cluster: importing %s as %s on node %s", ref, name, best.node_id)
        return await client.import_image(ref, name, credentials, on_event)

    async def delete_snapshot(self, snapshot_id: str) -> bool:
        """Every live node deletes its copy (the first also the bucket's). A node that is down
        deletes its copy when it comes back, before it registers (the tombstone written
        first, `cluster.tombstones`); if no node answers, nothing is known deleted (503)."""
        if SNAPSHOT_ID.fullmatch(snapshot_id):
            await self.tombstones.add(snapshot_id)
        answers, failed = await self._ask_live(
            f"delete snapshot {snapshot_id}", lambda c: c.delete_snapshot(snapshot_id)
        )
        if failed and not answers:
            raise Unavailable(f"snapshot {snapshot_id}: no node could delete it now")
        return any(answers)

    async def remove_image(self, name: str) -> bool:
        """Every live node removes its copy; one that is down keeps it (an image is a cache:
        the next build from the same reference imports it again anyway)."""
        answers, _ = await self._ask_live(
            f"remove image template {name}", lambda c: c.remove_image(name)
        )
        return any(answers)

    def note_activity(self, sandbox_id: str) -> None:
        node_id = self._bound.get(sandbox_id)
        client = self._clients.get(node_id) if node_id is not None else None
        if client is not None:
            client.note_activity(sandbox_id)

    async def host_memory(self, sandbox_id: str) -> HostMemory | None:
        try:
            _, client = await self._route(sandbox_id)
        except Unavailable:
            return None
        return await client.host_memory(sandbox_id)

    async def nodes(self) -> list[NodeStatus]:
        infos = await self.membership.list_nodes()
        reasons = {c.node_id: c.reason for c in await self.membership.cordons()}
        bound = await self.bindings.all()
        counts: dict[str, int] = {}
        for node_id in bound.values():
            counts[node_id] = counts.get(node_id, 0) + 1
        return [_status(i, reasons.get(i.node_id, ""), counts.get(i.node_id, 0)) for i in infos]

    async def node(self, node_id: str) -> NodeStatus:
        for st in await self.nodes():
            if st.node_id == node_id:
                return st
        raise UnknownNode(f"no node {node_id!r} is a member of the cluster now")

    async def sandboxes_on(self, node_id: str) -> list[str]:
        await self.node(node_id)
        return sorted(await self.bindings.of_node(node_id))

    async def cordon(self, node_id: str, *, cordoned: bool, reason: str = "") -> NodeStatus:
        await self.node(node_id)
        if cordoned:
            await self.membership.cordon(node_id, reason or "cordoned")
        else:
            await self.membership.uncordon(node_id)
        return await self.node(node_id)


def _status(info: NodeInfo, reason: str, bound: int) -> NodeStatus:
    return NodeStatus(
        node_id=info.node_id,
        state="cordoned" if info.cordoned else "ready",
        rpc_url=info.rpc_url,
        version=info.version,
        cpus=info.capacity.cpus,
        memory_mb=info.capacity.memory_mb,
        slots=info.capacity.slots,
        free_memory_mb=info.load.free_memory_mb,
        free_slots=info.load.free_slots,
        running=info.load.running,
        paused=max(0, bound - info.load.running),
        updated_at=info.load.updated_at,
        cordon_reason=reason if info.cordoned else "",
        gateway=info.gateway,
    )


def _checks(runtime: ClusterRuntime) -> tuple[Runtime, NodeDirectory]:
    return runtime, runtime
