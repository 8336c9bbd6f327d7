"""Which nodes are alive, what they can take, and which are cordoned.

A node agent registers a `NodeInfo` at `<prefix>nodes/<node_id>` under a lease of `ttl_s`
seconds and keeps the lease alive with a heartbeat (every ttl/3) that also republishes its load.
Liveness is the lease: when the agent dies or stops beating, etcd deletes the record once the
lease lapses, so "the key exists" is the whole definition of alive; nobody has to decide that a
node is dead.

Cordons live at `<prefix>cordons/<node_id>` with no lease: an operator's cordon is a decision
about the host, and must survive the agent restarting (and re-registering) on it. A node is
ready when its record exists and it is not cordoned.
"""

from __future__ import annotations

import json
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Literal

from agentenv.cluster.etcd import Etcd, KeyValue, PrefixWatch, WatchCompacted, get_op
from agentenv.cluster.leases import DEFAULT_TTL_S, LeasedRecord
from agentenv.cluster.mirror import PrefixMirror

log = logging.getLogger(__name__)

NODES = "nodes"
CORDONS = "cordons"


class BadRecord(ValueError):
    """A value in etcd is not what this version of agentenv writes there."""


@dataclass(frozen=True)
class Capacity:
    cpus: int
    memory_mb: int
    slots: int


@dataclass(frozen=True)
class Load:
    free_memory_mb: int
    running: int
    free_slots: int
    # When the node measured this (unix seconds); set by the heartbeat when it publishes.
    updated_at: float = 0.0


@dataclass(frozen=True)
class NodeInfo:
    node_id: str
    # Where the control plane calls the node agent.
    rpc_url: str
    # The host of this node (its RPC URL's); kept for older readers.
    address: str
    capacity: Capacity
    load: Load
    version: str
    # Not stored in the record: read from the cordon key whenever nodes are listed.
    cordoned: bool = False
    # Which agent this is: a token kept in its data dir, so a restart of the same agent
    # takes its record over and a second agent started with the same id is refused.
    instance: str = ""
    # Where a replica's proxy reaches this node's guests: its data gateway (HOST:PORT,
    # `agentenv.gateway`); "" = at their slot addresses directly (same host only).
    gateway: str = ""

    @property
    def ready(self) -> bool:
        """A listed node's lease is alive; ready means it also takes new sandboxes."""
        return not self.cordoned

    def to_json(self) -> bytes:
        record = asdict(self)
        del record["cordoned"]
        return json.dumps(record, sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes, *, cordoned: bool = False) -> NodeInfo:
        try:
            record = json.loads(data)
            return cls(
                node_id=str(record["node_id"]),
                rpc_url=str(record["rpc_url"]),
                address=str(record["address"]),
                capacity=Capacity(**record["capacity"]),
                load=Load(**record["load"]),
                version=str(record["version"]),
                cordoned=cordoned,
                instance=str(record.get("instance", "")),
                gateway=str(record.get("gateway", "")),
            )
        except (ValueError, KeyError, TypeError) as error:
            raise BadRecord(f"node record {data[:200]!r}: {error}") from error


@dataclass(frozen=True)
class Cordon:
    node_id: str
    reason: str
    since: float


@dataclass(frozen=True)
class NodeEvent:
    kind: Literal["joined", "left"]
    node_id: str
    # The record that joined; None for a node that left.
    info: NodeInfo | None = None


def _id_from_key(etcd: Etcd, kind: str, key: bytes) -> str:
    return key[len(etcd.dir(kind)) :].decode()


class Membership:
    """Reads of the member list, cordons, and the join/leave watch.

    A control-plane replica passes `mirrored=True` and starts `mirrors` (`cluster.mirror`):
    `list_nodes`, which placement calls per create, then answers from them while they are in
    step."""

    def __init__(self, etcd: Etcd, *, mirrored: bool = False) -> None:
        self._etcd = etcd
        self.mirrors: tuple[PrefixMirror, PrefixMirror] | None = None
        if mirrored:
            self.mirrors = (
                PrefixMirror(etcd, etcd.dir(NODES), NODES),
                PrefixMirror(etcd, etcd.dir(CORDONS), CORDONS),
            )

    async def list_nodes(self) -> list[NodeInfo]:
        """Every node whose lease is alive, with `cordoned` set, sorted by id."""
        records = cordons = None
        if self.mirrors is not None:
            records = self.mirrors[0].under(self._etcd.dir(NODES))
            cordons = self.mirrors[1].under(self._etcd.dir(CORDONS))
        if not records or cordons is None:
            # Records and cordons in one transaction, so both are read at the same revision.
            result = await self._etcd.txn(
                [],
                [
                    get_op(self._etcd.dir(NODES), prefix=True),
                    get_op(self._etcd.dir(CORDONS), prefix=True),
                ],
            )
            records, cordons = result.ranges
        cordoned = {_id_from_key(self._etcd, CORDONS, kv.key) for kv in cordons}
        nodes = []
        for kv in records:
            node = self._parse(kv, cordoned)
            if node is not None:
                nodes.append(node)
        return sorted(nodes, key=lambda node: node.node_id)

    async def ready_nodes(self) -> list[NodeInfo]:
        return [node for node in await self.list_nodes() if node.ready]

    async def get_node(self, node_id: str) -> NodeInfo | None:
        result = await self._etcd.txn(
            [], [get_op(self._etcd.key(NODES, node_id)), get_op(self._etcd.key(CORDONS, node_id))]
        )
        records, cordons = result.ranges
        if not records:
            return None
        return NodeInfo.from_json(records[0].value, cordoned=bool(cordons))

    def _parse(self, kv: KeyValue, cordoned: set[str]) -> NodeInfo | None:
        node_id = _id_from_key(self._etcd, NODES, kv.key)
        try:
            return NodeInfo.from_json(kv.value, cordoned=node_id in cordoned)
        except BadRecord as error:
            # One node on another version must not hide every other node from placement.
            log.warning("skipping node %s: %s", node_id, error)
            return None

    async def cordon(self, node_id: str, reason: str = "") -> None:
        """No new sandboxes go to the node; persistent, whether or not the node is alive."""
        record = asdict(Cordon(node_id, reason, time.time()))
        key = self._etcd.key(CORDONS, node_id)
        self._written(key)
        await self._etcd.put(key, json.dumps(record).encode())

    async def uncordon(self, node_id: str) -> bool:
        """False when the node was not cordoned."""
        key = self._etcd.key(CORDONS, node_id)
        self._written(key)
        return await self._etcd.delete(key)

    def _written(self, cordon: bytes) -> None:
        # This replica reads its own cordon at once (a create right after it must not go
        # there): the mirror does not answer for it until the watch brings the change.
        if self.mirrors is not None:
            self.mirrors[1].forget(cordon)

    async def cordons(self) -> list[Cordon]:
        """Every cordon, also those of nodes that are not alive now."""
        kvs, _ = await self._etcd.get_prefix(self._etcd.dir(CORDONS))
        found = []
        for kv in kvs:
            try:
                found.append(Cordon(**json.loads(kv.value)))
            except (ValueError, TypeError) as error:
                log.warning("skipping cordon %r: %s", kv.key, error)
        return found

    def watch(self, *, include_existing: bool = True) -> NodeWatch:
        """Joins and leaves from now on; with `include_existing`, the live nodes first."""
        return NodeWatch(self._etcd, include_existing=include_existing)


class NodeWatch:
    """Async iterator of `NodeEvent`s; `stop()` (or leaving `async with`) ends it cleanly.

    Built on the revisions etcd gives every change: the current list is read at revision R and
    the watch starts at R+1, so nothing between the two is missed. Heartbeats rewrite a live
    node's record under the same lease; those are not joins and are not reported. A record
    written under another lease while the old one still stood is a join again: the agent
    restarted (or registered anew) within its TTL, so what it holds may have changed.
    """

    def __init__(self, etcd: Etcd, *, include_existing: bool) -> None:
        self._etcd = etcd
        self._include_existing = include_existing
        # node id -> the lease its record is under.
        self._known: dict[str, int] = {}
        self._pending: deque[NodeEvent] = deque()
        self._watch: PrefixWatch | None = None
        self._started = False
        self._stopped = False

    def __aiter__(self) -> NodeWatch:
        return self

    async def __aenter__(self) -> NodeWatch:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def _sync(self, report: bool) -> None:
        """Reads the live nodes, queues the differences from what was known, watches on."""
        kvs, revision = await self._etcd.get_prefix(self._etcd.dir(NODES))
        current: dict[str, NodeInfo | None] = {}
        leases: dict[str, int] = {}
        for kv in kvs:
            node_id = _id_from_key(self._etcd, NODES, kv.key)
            leases[node_id] = kv.lease
            try:
                current[node_id] = NodeInfo.from_json(kv.value)
            except BadRecord:
                current[node_id] = None
        if report:
            for node_id in sorted(self._known.keys() - current.keys()):
                self._pending.append(NodeEvent("left", node_id))
            for node_id in sorted(current):
                if self._known.get(node_id) != leases[node_id]:
                    self._pending.append(NodeEvent("joined", node_id, current[node_id]))
        self._known = leases
        self._watch = self._etcd.watch_prefix(self._etcd.dir(NODES), revision + 1)

    async def __anext__(self) -> NodeEvent:
        if not self._started:
            self._started = True
            await self._sync(report=self._include_existing)
        while not self._pending:
            if self._stopped or self._watch is None:
                raise StopAsyncIteration
            try:
                event = await self._watch.__anext__()
            except WatchCompacted:
                # Missed history: the difference between what we knew and now is what happened.
                await self._sync(report=True)
                continue
            node_id = _id_from_key(self._etcd, NODES, event.kv.key)
            if event.kind == "delete":
                if node_id in self._known:
                    del self._known[node_id]
                    self._pending.append(NodeEvent("left", node_id))
            elif self._known.get(node_id) != event.kv.lease:
                # New, or registered again under a new lease (restarted within its TTL).
                self._known[node_id] = event.kv.lease
                try:
                    info: NodeInfo | None = NodeInfo.from_json(event.kv.value)
                except BadRecord:
                    info = None
                self._pending.append(NodeEvent("joined", node_id, info))
        return self._pending.popleft()

    async def stop(self) -> None:
        self._stopped = True
        if self._watch is not None:
            await self._watch.stop()


class NodeRegistration(LeasedRecord):
    """A node's membership: its record and every other key that lives and dies with it.

    `start()` registers and starts the heartbeat; `stop()` ends it and revokes the lease, so the
    node's keys vanish at once instead of after a TTL. Keys added with `hold()` (the node's
    template and snapshot locations) share the lease; when a heartbeat finds the lease gone
    (etcd lost it, or this process was paused past the TTL) the node registers again under a
    new lease with all of them, and logs that it did (`leases.LeasedRecord`). Each beat also
    republishes the node's load.
    """

    def __init__(
        self,
        etcd: Etcd,
        info: NodeInfo,
        *,
        ttl_s: int = DEFAULT_TTL_S,
        load_source: Callable[[], Load] | None = None,
    ) -> None:
        super().__init__(
            etcd, etcd.key(NODES, info.node_id), ttl_s=ttl_s, label=f"node {info.node_id}"
        )
        self.info = info
        # Called at each heartbeat for the load to publish; None: what `set_load` gave.
        self.load_source = load_source

    def set_load(self, load: Load) -> None:
        self.info = replace(self.info, load=load)

    def _conflict(self, current: bytes) -> str | None:
        try:
            theirs = NodeInfo.from_json(current)
        except BadRecord:
            return None
        if not theirs.instance or not self.info.instance or theirs.instance == self.info.instance:
            return None
        return (
            f"another agent ({theirs.rpc_url}, another data dir) is registered as node "
            f"{theirs.node_id} and alive; give each node its own AGENTENV_NODE_ID"
        )

    def _record(self) -> bytes:
        load = self.load_source() if self.load_source is not None else self.info.load
        self.info = replace(self.info, load=replace(load, updated_at=time.time()))
        return self.info.to_json()
