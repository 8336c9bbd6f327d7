"""The cluster runtime's state and per-call routing (`ClusterRouting`): a node RPC client per
live node, a sandbox's node from its binding (`_route`), questions to every live node
(`_ask_live`), lost-sandbox delivery. Split from `runtime.py`; placement (`placement`) and
reconciliation (`reconcile`) are mixins over it, put together by `runtime.ClusterRuntime`."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from agentenv.cluster.bindings import Bindings
from agentenv.cluster.catalog import SharedCatalog
from agentenv.cluster.etcd import Etcd
from agentenv.cluster.locations import Locations
from agentenv.cluster.membership import Membership, NodeInfo
from agentenv.cluster.mirror import PrefixMirror
from agentenv.cluster.tombstones import SnapshotTombstones
from agentenv.config import Settings
from agentenv.contract.errors import Unavailable
from agentenv.noderpc.client import RemoteRuntime

log = logging.getLogger("agentenv.cluster.runtime")
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


class ClusterRouting:
    """State of a control-plane replica's cluster runtime and the routing of its calls."""

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
        # Mirrored (`cluster.mirror`): placement reads these directories per create.
        self.membership = Membership(self.etcd, mirrored=True)
        self.bindings = Bindings(self.etcd)
        self.locations = Locations(self.etcd, mirrored=True)
        self.catalog = SharedCatalog(self.etcd, mirrored=True)
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

    @property
    def mirrors(self) -> list[PrefixMirror]:
        """The copies of etcd directories this replica keeps (started with the runtime)."""
        found = list(self.membership.mirrors or ())
        found += [m for m in (self.locations.mirror, self.catalog.mirror) if m is not None]
        return found

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

    def _spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _deliver(self, sandbox_id: str, why: str) -> None:
        for handler in list(self._handlers):
            try:
                handler(sandbox_id, why)
            except Exception:
                log.exception("cluster: lost handler failed for %s", sandbox_id)

    async def _node_of(self, sandbox_id: str) -> str | None:
        node_id = await self.bindings.get(sandbox_id)
        if node_id is None:
            self._bound.pop(sandbox_id, None)
        else:
            self._bound[sandbox_id] = node_id
        return node_id

    async def _route(
        self, sandbox_id: str, bound_to: str | None = None
    ) -> tuple[str, RemoteRuntime]:
        """The client of the live node the sandbox is bound to (`bound_to` when the caller
        has just read its binding); `NodeDown` if it is not."""
        node_id = bound_to or await self._node_of(sandbox_id)
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

    async def _forget_on(self, node_id: str, sandbox_id: str) -> None:
        client = self._clients.get(node_id)
        if client is None:
            return
        try:
            await client.forget(sandbox_id)
        except Exception as exc:
            log.warning("node %s kept its old copy of %s: %s", node_id, sandbox_id, exc)

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
