"""Which nodes hold a local copy of a template's layers or snapshot (page cache warm).

`<prefix>locations/<kind>/<id>/<node_id>`, written under the holder's membership lease: when the
node dies its copies stop counting by themselves, and placement never prefers a dead node for
what it held. The node's `NodeRegistration` remembers them and writes them again under a new
lease if it has to register again.
"""

from __future__ import annotations

import json
import time

from agentenv.cluster.etcd import Etcd
from agentenv.cluster.membership import NodeRegistration

LOCATIONS = "locations"
# What a node may hold a copy of.
KINDS = frozenset({"template", "snapshot", "layer"})


def _check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"location kind {kind!r}: expected one of {sorted(KINDS)}")


class Locations:
    """Reads for anyone; `add`/`remove` for the node agent, which passes its registration."""

    def __init__(self, etcd: Etcd, registration: NodeRegistration | None = None) -> None:
        self._etcd = etcd
        self._registration = registration

    def _own(self) -> NodeRegistration:
        if self._registration is None:
            raise RuntimeError("Locations without a NodeRegistration can only read")
        return self._registration

    async def add(self, kind: str, item_id: str) -> None:
        """This node holds `kind`/`item_id` until `remove` or the node's death."""
        _check_kind(kind)
        registration = self._own()
        node_id = registration.info.node_id
        key = self._etcd.key(LOCATIONS, kind, item_id, node_id)
        value = json.dumps({"node_id": node_id, "added_at": time.time()}).encode()
        await registration.hold(key, value)

    async def remove(self, kind: str, item_id: str) -> None:
        _check_kind(kind)
        registration = self._own()
        await registration.release(
            self._etcd.key(LOCATIONS, kind, item_id, registration.info.node_id)
        )

    async def holders(self, kind: str, item_id: str) -> list[str]:
        """Ids of the live nodes that hold a copy, sorted."""
        _check_kind(kind)
        prefix = self._etcd.dir(LOCATIONS, kind, item_id)
        kvs, _ = await self._etcd.get_prefix(prefix)
        return sorted(kv.key[len(prefix) :].decode() for kv in kvs)
