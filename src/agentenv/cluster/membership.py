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

import asyncio
import json
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any, Literal

from agentenv.cluster.etcd import (
    ClusterUnavailable,
    Etcd,
    KeyValue,
    LeaseNotFound,
    PrefixWatch,
    WatchCompacted,
    get_op,
    put_op,
)

log = logging.getLogger(__name__)

DEFAULT_TTL_S = 10
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
    # Where a replica's proxy reaches this node's guests (host or host:port).
    address: str
    capacity: Capacity
    load: Load
    version: str
    # Not stored in the record: read from the cordon key whenever nodes are listed.
    cordoned: bool = False

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
    """Reads of the member list, cordons, and the join/leave watch."""

    def __init__(self, etcd: Etcd) -> None:
        self._etcd = etcd

    async def list_nodes(self) -> list[NodeInfo]:
        """Every node whose lease is alive, with `cordoned` set, sorted by id."""
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
        await self._etcd.put(self._etcd.key(CORDONS, node_id), json.dumps(record).encode())

    async def uncordon(self, node_id: str) -> bool:
        """False when the node was not cordoned."""
        return await self._etcd.delete(self._etcd.key(CORDONS, node_id))

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
    node's record; those are not joins and are not reported.
    """

    def __init__(self, etcd: Etcd, *, include_existing: bool) -> None:
        self._etcd = etcd
        self._include_existing = include_existing
        self._known: set[str] = set()
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
        for kv in kvs:
            node_id = _id_from_key(self._etcd, NODES, kv.key)
            try:
                current[node_id] = NodeInfo.from_json(kv.value)
            except BadRecord:
                current[node_id] = None
        if report:
            for node_id in sorted(self._known - current.keys()):
                self._pending.append(NodeEvent("left", node_id))
            for node_id in sorted(current.keys() - self._known):
                self._pending.append(NodeEvent("joined", node_id, current[node_id]))
        self._known = set(current)
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
                    self._known.discard(node_id)
                    self._pending.append(NodeEvent("left", node_id))
            elif node_id not in self._known:
                self._known.add(node_id)
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


class NodeRegistration:
    """A node's membership: its record and every other key that lives and dies with it.

    `start()` registers and starts the heartbeat; `stop()` ends it and revokes the lease, so the
    node's keys vanish at once instead of after a TTL. Keys added with `hold()` (the node's
    template and snapshot locations) share the lease; when a heartbeat finds the lease gone
    (etcd lost it, or this process was paused past the TTL) the node registers again under a
    new lease with all of them, and logs that it did.
    """

    def __init__(
        self,
        etcd: Etcd,
        info: NodeInfo,
        *,
        ttl_s: int = DEFAULT_TTL_S,
        load_source: Callable[[], Load] | None = None,
    ) -> None:
        self.etcd = etcd
        self.info = info
        self.ttl_s = ttl_s
        # Called at each heartbeat for the load to publish; None: what `set_load` gave.
        self.load_source = load_source
        self.lease_id = 0
        # How many times this node registered: 1 after start, one more per lost lease.
        self.registrations = 0
        self._held: dict[bytes, bytes] = {}
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        # Beats, holds and re-registration never interleave: a re-registration must carry
        # every held key, and a hold must not land on a lease that is being replaced.
        self._lock = asyncio.Lock()

    @property
    def key(self) -> bytes:
        return self.etcd.key(NODES, self.info.node_id)

    @property
    def interval_s(self) -> float:
        return self.ttl_s / 3

    async def start(self) -> None:
        """Registers (raises `ClusterUnavailable` if etcd cannot be reached) and beats."""
        async with self._lock:
            await self._register()
        self._stopping = False
        self._task = asyncio.create_task(self._heartbeats(), name=f"heartbeat {self.info.node_id}")

    async def stop(self, *, deregister: bool = True) -> None:
        """Stops beating; with `deregister` the node's keys go now, else when the lease lapses."""
        task, self._task = self._task, None
        # Also a flag, not only the cancel: the loop must end even if a cancel is swallowed.
        self._stopping = True
        if task is not None:
            task.cancel()
            # The heartbeat's own end, not ours: a cancel of the caller still propagates.
            await asyncio.gather(task, return_exceptions=True)
        if deregister and self.lease_id:
            lease, self.lease_id = self.lease_id, 0
            await self.etcd.revoke_lease(lease)

    def set_load(self, load: Load) -> None:
        self.info = replace(self.info, load=load)

    async def hold(self, key: bytes, value: bytes) -> None:
        """Puts `key` under the node's lease, and again under each new lease."""
        async with self._lock:
            self._held[key] = value
            if not self.lease_id:  # not registered (yet, or any more): start() will write it
                return
            try:
                await self.etcd.put(key, value, lease=self.lease_id)
            except LeaseNotFound:
                await self._register()

    async def release(self, key: bytes) -> None:
        async with self._lock:
            self._held.pop(key, None)
            await self.etcd.delete(key)

    def holds(self, key: bytes) -> bool:
        return key in self._held

    def _record(self) -> bytes:
        load = self.load_source() if self.load_source is not None else self.info.load
        self.info = replace(self.info, load=replace(load, updated_at=time.time()))
        return self.info.to_json()

    async def _register(self) -> None:
        lost = self.lease_id
        lease = await self.etcd.grant_lease(self.ttl_s)
        # The record and every held key in one transaction: a reader never sees the node
        # without the locations it holds.
        ops: list[Any] = [get_op(self.key), put_op(self.key, self._record(), lease)]
        ops += [put_op(key, value, lease) for key, value in self._held.items()]
        result = await self.etcd.txn([], ops)
        self.lease_id = lease
        self.registrations += 1
        previous = result.ranges[0]
        if lost:
            log.warning(
                "node %s: lease %x was lost (expired or revoked); registered again with lease %x",
                self.info.node_id,
                lost,
                lease,
            )
        elif previous and previous[0].lease != lease:
            # An earlier run of this agent (or another agent with the same id) left a record.
            log.info(
                "node %s: replaced the record of lease %x with lease %x",
                self.info.node_id,
                previous[0].lease,
                lease,
            )
        else:
            log.info(
                "node %s: registered with lease %x (ttl %d s)", self.info.node_id, lease, self.ttl_s
            )

    async def beat(self) -> None:
        """One heartbeat: keep the lease alive, republish the load; re-register if lost."""
        async with self._lock:
            if await self.etcd.refresh_lease(self.lease_id) <= 0:
                await self._register()
                return
            try:
                await self.etcd.put(self.key, self._record(), lease=self.lease_id)
            except LeaseNotFound:  # lapsed between the two calls
                await self._register()

    async def _heartbeats(self) -> None:
        loop = asyncio.get_running_loop()
        while not self._stopping:
            started = loop.time()
            try:
                await self.beat()
            except ClusterUnavailable as error:
                # The lease may still be alive (etcd extends leases across a leader change);
                # the next beat finds out, and re-registers if it is gone.
                log.warning("node %s: heartbeat failed: %s", self.info.node_id, error)
            except Exception:
                log.exception("node %s: heartbeat failed", self.info.node_id)
            await asyncio.sleep(max(0.0, started + self.interval_s - loop.time()))
