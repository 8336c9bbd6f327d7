"""Which control-plane replicas are alive, so a dead one's operations can be finished.

Each replica (one `aenv serve` process with `AGENTENV_ETCD`) registers at
`<prefix>replicas/<replica_id>` under a lease kept by a heartbeat, exactly as a node agent
registers (`leases.LeasedRecord`): alive means the key exists. The id is new at every process
start, so a replica that restarts is a new replica, and the rows the old process left in a
transitional state (stamped with the old id by the state machine) belong to nobody alive.
`control.sandboxes.SandboxManager`'s sweep reads `live_replicas` to find those rows.
"""

from __future__ import annotations

import json
import os
import socket
import time
import uuid

from agentenv.cluster.etcd import Etcd
from agentenv.cluster.leases import DEFAULT_TTL_S, LeasedRecord

REPLICAS = "replicas"


async def live_replicas(etcd: Etcd) -> set[str]:
    """The ids of every replica whose lease is alive (one read, with the client's deadline)."""
    kvs, _ = await etcd.get_prefix(etcd.dir(REPLICAS))
    start = len(etcd.dir(REPLICAS))
    return {kv.key[start:].decode() for kv in kvs}


class ReplicaLease(LeasedRecord):
    """This process's membership among the control-plane replicas.

    `start()` registers (raises `ClusterUnavailable` if etcd cannot be reached) and beats;
    `close()` revokes the lease, so what this replica leaves half-done is someone else's at
    once rather than a TTL later, and closes the etcd client if this lease owns it.
    """

    def __init__(
        self,
        etcd: Etcd,
        *,
        replica_id: str | None = None,
        ttl_s: int = DEFAULT_TTL_S,
        owns_etcd: bool = False,
    ) -> None:
        self.replica_id = replica_id or uuid.uuid4().hex
        super().__init__(
            etcd,
            etcd.key(REPLICAS, self.replica_id),
            ttl_s=ttl_s,
            label=f"replica {self.replica_id}",
        )
        self.started_at = time.time()
        self._owns_etcd = owns_etcd

    def _record(self) -> bytes:
        # For people reading etcd: which process this is. Nothing reads it back.
        record = {
            "replica_id": self.replica_id,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "started_at": self.started_at,
        }
        return json.dumps(record, sort_keys=True).encode()

    async def live(self) -> set[str]:
        return await live_replicas(self.etcd)

    async def close(self) -> None:
        try:
            await self.stop(deregister=True)
        finally:
            if self._owns_etcd:
                await self.etcd.close()
