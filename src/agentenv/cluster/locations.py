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
from agentenv.cluster.mirror import PrefixMirror

LOCATIONS = "locations"
# What a node may hold a copy of.
KINDS = frozenset({"template", "snapshot", "layer"})


def _check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"location kind {kind!r}: expected one of {sorted(KINDS)}")


class Locations:
    """Reads for anyone; `add`/`remove` for the node agent, which passes its registration.
    A control-plane replica passes `mirrored=True` and starts `mirror`: `holders`, which
    placement calls twice per create, then answers from it while it is in step."""

    def __init__(
        self,
        etcd: Etcd,
        registration: NodeRegistration | None = None,
        *,
        mirrored: bool = False,
    ) -> None:
        self._etcd = etcd
        self._registration = registration
        self.mirror = PrefixMirror(etcd, etcd.dir(LOCATIONS), LOCATIONS) if mirrored else None

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

    async def holders(self, kind: str, item_id: str, *, preference: bool = False) -> list[str]:
        """Ids of the live nodes that hold a copy, sorted. `preference`: the answer only
        orders the nodes, so the mirror's "none" is taken as it is; otherwise "none" is read
        again from etcd (a copy taken a moment ago may not have reached the mirror, and a
        create without object storage goes only where a copy is)."""
        _check_kind(kind)
        prefix = self._etcd.dir(LOCATIONS, kind, item_id)
        kvs = self.mirror.under(prefix) if self.mirror is not None else None
        if kvs is None or not (kvs or preference):
            kvs, _ = await self._etcd.get_prefix(prefix)
        return sorted(kv.key[len(prefix) :].decode() for kv in kvs)
