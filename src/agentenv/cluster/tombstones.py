"""Snapshots deleted from the cluster, so a node that was down at the delete drops its copy.

A delete asks every live node; one that is down (or partitioned) keeps its files and, when it
comes back, would publish and serve the snapshot again. So the delete first writes
`<prefix>deleted-snapshots/<snapshot id>` (not leased: it must outlive any node's absence),
and a node agent deletes every copy it holds that has a tombstone before it registers and at
each publication after. Snapshot ids are random and never reused, so a tombstone never hides
a later snapshot; each is one small key.
"""

from __future__ import annotations

import json
import time

from agentenv.cluster.etcd import Etcd

TOMBSTONES = "deleted-snapshots"


class SnapshotTombstones:
    def __init__(self, etcd: Etcd) -> None:
        self._etcd = etcd

    async def add(self, snapshot_id: str) -> None:
        value = json.dumps({"deleted_at": time.time()}).encode()
        await self._etcd.put(self._etcd.key(TOMBSTONES, snapshot_id), value)

    async def has(self, snapshot_id: str) -> bool:
        return await self._etcd.get(self._etcd.key(TOMBSTONES, snapshot_id)) is not None

    async def all(self) -> set[str]:
        prefix = self._etcd.dir(TOMBSTONES)
        kvs, _ = await self._etcd.get_prefix(prefix)
        return {kv.key[len(prefix) :].decode() for kv in kvs}
