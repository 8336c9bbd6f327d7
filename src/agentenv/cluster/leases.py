"""A record that lives as long as its writer: one key under an etcd lease, kept by a heartbeat.

Both kinds of cluster member use this: a node agent (`membership.NodeRegistration`, its record
and the locations it holds) and a control-plane replica (`replicas.ReplicaLease`). The member
writes its record under a lease of `ttl_s` seconds and refreshes the lease every ttl/3; when it
dies (or stops beating) etcd deletes the record once the lease lapses, so "the key exists" is
the whole definition of alive and nobody has to decide that a member is dead.

Keys added with `hold()` share the lease. When a heartbeat finds the lease gone (etcd lost it,
or the process was paused past the TTL), the record and every held key are written again
under a new lease in one transaction, and that is logged.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from agentenv.cluster.etcd import ClusterUnavailable, Etcd, LeaseNotFound, get_op, put_op

log = logging.getLogger(__name__)

DEFAULT_TTL_S = 10


class DuplicateMember(Exception):
    """Another live member holds this member's key (two agents started with one node id)."""


class LeasedRecord:
    """`start()` registers and starts the heartbeat; `stop()` ends it and revokes the lease,
    so the member's keys vanish at once instead of after a TTL. Subclasses say what the
    record holds (`_record`, called at every registration and beat)."""

    def __init__(self, etcd: Etcd, key: bytes, *, ttl_s: int, label: str) -> None:
        self.etcd = etcd
        self.key = key
        self.ttl_s = ttl_s
        # Names the member in log lines ("node node-a", "replica 3f2a...").
        self.label = label
        self.lease_id = 0
        # How many times this member registered: 1 after start, one more per lost lease.
        self.registrations = 0
        self._held: dict[bytes, bytes] = {}
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        # Beats, holds and re-registration never interleave: a re-registration must carry
        # every held key, and a hold must not land on a lease that is being replaced.
        self._lock = asyncio.Lock()

    def _record(self) -> bytes:
        raise NotImplementedError

    def _conflict(self, current: bytes) -> str | None:
        """Why the record now at the key is another live member's (None: it is ours, or a
        previous run's of this member). The default: any record is ours."""
        return None

    @property
    def interval_s(self) -> float:
        return self.ttl_s / 3

    async def start(self) -> None:
        """Registers (raises `ClusterUnavailable` if etcd cannot be reached) and beats. A key
        another live member holds is waited for one TTL (it may be a dead run's, lapsing),
        then `DuplicateMember`."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.ttl_s + 1.0
        while True:
            found = await self.etcd.get(self.key)
            why = self._conflict(found.value) if found is not None else None
            if why is None:
                break
            if loop.time() >= deadline:
                raise DuplicateMember(f"{self.label}: {why}")
            await asyncio.sleep(0.5)
        async with self._lock:
            await self._register()
        self._stopping = False
        self._task = asyncio.create_task(self._heartbeats(), name=f"heartbeat {self.label}")

    async def stop(self, *, deregister: bool = True) -> None:
        """Stops beating; with `deregister` the keys go now, else when the lease lapses."""
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

    async def hold(self, key: bytes, value: bytes) -> None:
        """Puts `key` under the member's lease, and again under each new lease."""
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

    async def _register(self) -> None:
        lost = self.lease_id
        lease = await self.etcd.grant_lease(self.ttl_s)
        # The record and every held key in one transaction: a reader never sees the member
        # without what it holds.
        ops: list[Any] = [get_op(self.key), put_op(self.key, self._record(), lease)]
        ops += [put_op(key, value, lease) for key, value in self._held.items()]
        result = await self.etcd.txn([], ops)
        self.lease_id = lease
        self.registrations += 1
        previous = result.ranges[0]
        if lost:
            log.warning(
                "%s: lease %x was lost (expired or revoked); registered again with lease %x",
                self.label,
                lost,
                lease,
            )
        elif previous and previous[0].lease != lease:
            # An earlier run of this member (or another with the same id) left a record.
            log.info(
                "%s: replaced the record of lease %x with lease %x",
                self.label,
                previous[0].lease,
                lease,
            )
        else:
            log.info("%s: registered with lease %x (ttl %d s)", self.label, lease, self.ttl_s)

    async def beat(self) -> None:
        """One heartbeat: keep the lease alive, rewrite the record; re-register if lost."""
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
                log.warning("%s: heartbeat failed: %s", self.label, error)
            except Exception:
                log.exception("%s: heartbeat failed", self.label)
            await asyncio.sleep(max(0.0, started + self.interval_s - loop.time()))
