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
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from agentenv.cluster.bindings import Bindings
from agentenv.cluster.catalog import SharedCatalog
from agentenv.cluster.etcd import Etcd
from agentenv.cluster.locations import Locations
from agentenv.cluster.membership import Membership, NodeInfo
from agentenv.cluster.tombstones import SnapshotTombstones
from agentenv.config import Settings
from agentenv.contract.errors import BadRequest, Unavailable
from agentenv.contract.nodes import NodeDirectory, NodeStatus, UnknownNode
from agentenv.contract.runtime import (
    SNAPSHOT_ID,
    Found,
    HostMemory,
    ImportEvent,
    Placement,
    Runtime,
    SandboxSpec,
    SnapshotInfo,
    TemplateInfo,
)
from agentenv.network.egress import Egress
from agentenv.noderpc.client import RemoteRuntime
from agentenv.noderpc.errors import NodeUnreachable

log = logging.getLogger(__name__)

# Nodes sampled per placement ("power of K choices"): spreads concurrent creates, which all
# see the same published load, instead of sending every one to the emptiest node.
SAMPLE_K = 2
# What a node needs besides the guest's RAM (its QEMU), as the node's admission counts it.
VMM_OVERHEAD_MB = 128
# Retry-After when no node can take a sandbox now.
NO_NODE_RETRY_S = 5
# etcd reads in one node's reconciliation (each within the client's own deadline, 6 s).
RECONCILE_ETCD_S = 15.0
# Questions about missing sandboxes one node's check has in flight at once.
RECONCILE_ASKS = 16


T = TypeVar("T")

# How long a node's gateway address is used before its record is read again.
GATEWAY_FRESH_S = 10.0


class NodeDown(Unavailable):
    """The sandbox's node is not a member of the cluster now (503: it may come back)."""


@dataclass
class _Candidate:
    info: NodeInfo
    warm: bool
    # Creates this replica has in flight there (not yet in the node's published load).
    inflight_mb: int


class ClusterRuntime:
    """`Runtime` and `NodeDirectory` of a control-plane replica."""

    def __init__(
        self,
        settings: Settings,
        *,
        etcd: Etcd | None = None,
        sample_k: int = SAMPLE_K,
        rng: random.Random | None = None,
        reconcile_s: float | None = None,
        lost_grace_s: float | None = None,
    ) -> None:
        if not settings.node_token:
            raise ValueError("a cluster control plane needs the node token (AGENTENV_NODE_TOKEN)")
        self.settings = settings
        self.token = settings.node_token
        self.etcd = etcd or Etcd.from_settings(settings)
        self.membership = Membership(self.etcd)
        self.bindings = Bindings(self.etcd)
        self.locations = Locations(self.etcd)
        self.catalog = SharedCatalog(self.etcd)
        self.tombstones = SnapshotTombstones(self.etcd)
        self.sample_k = max(1, sample_k)
        self._rng = rng or random.Random()
        self._clients: dict[str, RemoteRuntime] = {}
        self._urls: dict[str, str] = {}
        # node -> (its data gateway, "" = none; when read), from the latest record seen.
        self._gateways: dict[str, tuple[str, float]] = {}
        self._live: set[str] = set()
        # A hint only (sandbox -> node): `note_activity` cannot wait for etcd.
        self._bound: dict[str, str] = {}
        self._inflight_mb: dict[str, int] = {}
        # Creates this replica placed that the node's published load may not show yet: (when,
        # MiB) per node, counted until the node publishes a load measured after them.
        self._placed: dict[str, list[tuple[float, int]]] = {}
        self._handlers: list[Callable[[str, str], None]] = []
        self._watch_task: asyncio.Task[None] | None = None
        self._reconcile_task: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.reconcile_s = float(reconcile_s or settings.node_reconcile_s)
        rpc = settings.node_rpc
        # A binding made before its node is asked (create, resume elsewhere, fork) outlives
        # that call by at most its deadline: the binding is then dropped or moved back. One
        # the node lacks for longer, and says nothing about, is lost.
        self.lost_grace_s = rpc.long_s + rpc.query_s if lost_grace_s is None else lost_grace_s
        # One node's whole check: its list, a find and a lost reason per suspect, two reads.
        self.node_check_s = 3 * rpc.query_s + RECONCILE_ETCD_S
        # Bindings a node was found not to hold: sandbox -> (node, binding revision, since,
        # reported). Reported once per binding: a receiver that keeps it (a row that is not
        # running) is not told again at every check.
        self._missing: dict[str, tuple[str, int, float, bool]] = {}

    # -- lifecycle -----------------------------------------------------------------------------

    async def start(self) -> None:
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
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for client in self._clients.values():
            with contextlib.suppress(Exception):
                await client.close()
        self._clients.clear()
        await self.etcd.close()

    async def _client_for(self, info: NodeInfo) -> RemoteRuntime:
        client = self._clients.get(info.node_id)
        if client is not None and self._urls.get(info.node_id) == info.rpc_url:
            # A restarted agent keeps its RPC URL but its gateway may bind another port.
            self._gateways[info.node_id] = (info.gateway, time.monotonic())
            return client
        if client is not None:
            with contextlib.suppress(Exception):
                await client.close()
        self._gateways[info.node_id] = (info.gateway, time.monotonic())
        client = RemoteRuntime(info.rpc_url, self.token, config=self.settings.node_rpc)
        await client.start()
        client.watch_lost(self._deliver)
        self._clients[info.node_id] = client
        self._urls[info.node_id] = info.rpc_url
        return client

    async def _watch_nodes(self) -> None:
        while True:
            watch = self.membership.watch(include_existing=True)
            try:
                async for event in watch:
                    if event.kind == "joined":
                        self._live.add(event.node_id)
                        if event.info is not None:
                            self._spawn(self._joined(event.info))
                    else:
                        self._live.discard(event.node_id)
                        self._spawn(self._left(event.node_id))
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("cluster: node watch failed (%s); watching again", exc)
            finally:
                with contextlib.suppress(Exception):
                    await watch.stop()
            await asyncio.sleep(1.0)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _joined(self, info: NodeInfo) -> None:
        """A node (back) in the cluster: its client, and what it holds that nobody is bound
        to any more (killed while it was away) goes."""
        try:
            client = await self._client_for(info)
            held = await client.sandbox_ids()
            for rid in held:
                bound = await self.bindings.get(rid)
                if bound is None:
                    log.warning(
                        "node %s holds %s, bound to no node: deleting it", info.node_id, rid
                    )
                    with contextlib.suppress(Exception):
                        await client.delete(rid)
                elif bound != info.node_id:
                    # Resumed elsewhere while this node was away: only its old copy goes.
                    log.warning("node %s holds an old copy of %s (now on %s): dropping it",
                                info.node_id, rid, bound)  # fmt: skip
                    with contextlib.suppress(Exception):
                        await client.forget(rid)
        except Exception as exc:
            log.warning("cluster: reconciling node %s failed: %s", info.node_id, exc)
            return
        # And the other way: what is bound to it that it came back without.
        await self._check_node(info.node_id, set(held))

    # -- reconciliation: bindings to a live node that no longer holds the sandbox ------------

    async def _reconcile_forever(self) -> None:
        while True:
            # Jittered: replicas started together do not ask every node at the same moment.
            await asyncio.sleep(self.reconcile_s * self._rng.uniform(0.9, 1.1))
            await self.reconcile()

    async def reconcile(self) -> None:
        """One check of every live node, all at once: a slow node holds up only its own."""
        await asyncio.gather(*(self._check_node(n) for n in sorted(self._live)))

    async def _check_node(self, node_id: str, held: set[str] | None = None) -> None:
        """Reports lost what is bound to the node but not there (`held`: its list, if just
        asked). Never raises; gives up on the node at `node_check_s`."""
        try:
            async with asyncio.timeout(self.node_check_s):
                await self._check_node_now(node_id, held)
        except TimeoutError:
            log.warning("cluster: node %s not reconciled within %g s", node_id, self.node_check_s)
        except Exception as exc:
            log.warning("cluster: reconciling node %s failed: %s", node_id, exc)

    async def _check_node_now(self, node_id: str, held: set[str] | None) -> None:
        client = self._clients.get(node_id)
        if client is None or node_id not in self._live:
            return
        before = await self.bindings.of_node_revisions(node_id)
        if held is None:
            held = set(await client.sandbox_ids())
        suspects = {rid: rev for rid, rev in before.items() if rid not in held}
        for rid, (on, *_) in list(self._missing.items()):
            if on == node_id and rid not in suspects:
                del self._missing[rid]
        if not suspects:
            return
        # Asked after the list: a create that finished meanwhile is there now.
        asking = asyncio.Semaphore(RECONCILE_ASKS)
        answers = await asyncio.gather(*(self._ask(client, rid, asking) for rid in suspects))
        # Read again after the node answered: a binding that moved (a resume elsewhere) or
        # was made again meanwhile is not this node's to lose.
        after = await self.bindings.of_node_revisions(node_id)
        now = time.monotonic()
        for (rid, rev), (there, why) in zip(suspects.items(), answers, strict=True):
            if there or after.get(rid) != rev:
                self._missing.pop(rid, None)
                continue
            seen = self._missing.get(rid)
            if seen is None or seen[:2] != (node_id, rev):
                seen = self._missing[rid] = (node_id, rev, now, False)
            if seen[3] or (why is None and now - seen[2] < self.lost_grace_s):
                # Told already; or it may still be on its way there (a create in flight).
                continue
            self._missing[rid] = (node_id, rev, seen[2], True)
            if why is None:
                why = f"not there for {now - seen[2]:.0f} s"
            log.warning("cluster: node %s no longer holds %s: %s", node_id, rid, why)
            self._deliver(rid, f"its node {node_id} no longer has it: {why}")

    async def _ask(
        self, client: RemoteRuntime, sandbox_id: str, asking: asyncio.Semaphore
    ) -> tuple[bool, str | None]:
        """(held, why): the reason the node lost the sandbox when it knows one (its restart
        found the VM gone), asked first: a stale copy in the bucket would make `find` say
        paused. Else whether it holds it after all (running, paused on its disk or in the
        bucket)."""
        async with asking:
            why = await client.lost_reason(sandbox_id)
            if why is not None:
                return False, why
            return await client.find(sandbox_id) is not None, None

    async def _left(self, node_id: str) -> None:
        why = f"its node {node_id} left the cluster (the agent stopped or its lease lapsed)"
        log.warning("cluster: node %s left", node_id)
        for rid, (on, *_) in list(self._missing.items()):
            if on == node_id:
                del self._missing[rid]
        try:
            bound = await self.bindings.of_node(node_id)
        except Exception as exc:
            log.warning("cluster: bindings of the departed node %s unknown: %s", node_id, exc)
            return
        for rid in bound:
            self._deliver(rid, why)

    def _deliver(self, sandbox_id: str, why: str) -> None:
        for handler in list(self._handlers):
            try:
                handler(sandbox_id, why)
            except Exception:
                log.exception("cluster: lost handler failed for %s", sandbox_id)

    # -- routing -------------------------------------------------------------------------------

    async def _node_of(self, sandbox_id: str) -> str | None:
        node_id = await self.bindings.get(sandbox_id)
        if node_id is None:
            self._bound.pop(sandbox_id, None)
        else:
            self._bound[sandbox_id] = node_id
        return node_id

    async def _route(self, sandbox_id: str) -> tuple[str, RemoteRuntime]:
        """The client of the live node the sandbox is bound to; `NodeDown` if it is not."""
        node_id = await self._node_of(sandbox_id)
        if node_id is None:
            raise Unavailable(f"sandbox {sandbox_id} is bound to no node", NO_NODE_RETRY_S)
        client = self._clients.get(node_id)
        if client is None or node_id not in self._live:
            info = await self.membership.get_node(node_id)
            if info is None:
                raise NodeDown(
                    f"sandbox {sandbox_id} is on node {node_id}, which is not a member of the "
                    "cluster now",
                    NO_NODE_RETRY_S,
                )
            self._live.add(node_id)
            client = await self._client_for(info)
        return node_id, client

    # -- placement -----------------------------------------------------------------------------

    async def _candidates(self, spec: SandboxSpec, template: str) -> list[NodeInfo]:
        nodes = [n for n in await self.membership.list_nodes() if n.ready]
        if not nodes:
            raise Unavailable("no node can take a sandbox: no ready node", NO_NODE_RETRY_S)
        # Nodes with the template's snapshot (or the snapshot itself) on disk: a restore from
        # their page cache, no fetch from object storage.
        snapshot_holders = set(await self.locations.holders("snapshot", template))
        warm = set(await self.locations.holders("template", template)) | snapshot_holders
        need = spec.memory_mb + VMM_OVERHEAD_MB
        cands = [_Candidate(n, n.node_id in warm, self._pending_mb(n)) for n in nodes]
        if snapshot_holders and self.settings.object_store is None:
            # Without object storage a snapshot can only be created from where it was taken.
            cands = [c for c in cands if c.info.node_id in snapshot_holders]
        catalog_holders = set(await self.catalog.holders(template)) if template else set()
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

    # -- the rest of the contract, routed by binding -------------------------------------------

    async def update_egress(self, sandbox_id: str, egress: Egress) -> None:
        _, client = await self._route(sandbox_id)
        await client.update_egress(sandbox_id, egress)

    async def delete(self, sandbox_id: str) -> None:
        node_id = await self._node_of(sandbox_id)
        if node_id is None:
            return
        try:
            _, client = await self._route(sandbox_id)
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
            home_id, client = await self._route(rid)
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

    async def _forget_on(self, node_id: str, sandbox_id: str) -> None:
        client = self._clients.get(node_id)
        if client is None:
            return
        try:
            await client.forget(sandbox_id)
        except Exception as exc:
            log.warning("node %s kept its old copy of %s: %s", node_id, sandbox_id, exc)

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
        node_id, client = await self._route(sandbox_id)
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

    async def _ask_live(
        self, what: str, call: Callable[[RemoteRuntime], Awaitable[T]]
    ) -> tuple[list[T], int]:
        """`call` on every live node at once: the answers of those that gave one, and how
        many did not (each logged)."""
        clients = [self._clients[n] for n in sorted(self._live) if n in self._clients]
        got = await asyncio.gather(*(call(c) for c in clients), return_exceptions=True)
        answers: list[T] = []
        failed = 0
        for answer in got:
            if isinstance(answer, BaseException):
                failed += 1
                log.warning("cluster: a node did not %s: %s", what, answer)
            else:
                answers.append(answer)
        return answers, failed

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

    # -- NodeDirectory -------------------------------------------------------------------------

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


def _fits(c: _Candidate, need_mb: int) -> bool:
    return c.info.load.free_slots > 0 and c.info.load.free_memory_mb - c.inflight_mb >= need_mb


def _score(c: _Candidate) -> tuple[bool, float]:
    """Warm first; then the larger share of the node left free (memory, CPUs, slots)."""
    info = c.info
    mem = (info.load.free_memory_mb - c.inflight_mb) / max(1, info.capacity.memory_mb)
    cpu = max(0, info.capacity.cpus - info.load.running) / max(1, info.capacity.cpus)
    slots = info.load.free_slots / max(1, info.capacity.slots)
    return c.warm, mem + 0.5 * cpu + 0.25 * min(1.0, slots)


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
