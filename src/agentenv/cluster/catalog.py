"""The cluster's template catalog: what each node can create from, published by the nodes.

`<prefix>catalog/<name>/<node_id>` holds one catalog template (`base`, `docker`, an imported
image) as that node has it: its size, layers and command defaults. Each node writes its own
entries under its membership lease, so a dead node's vanish with it, and control-plane replicas
read them: a replica needs no template of its own to resolve `base`, list the catalog, or key
a build's step cache on the base's layers.
"""

from __future__ import annotations

from agentenv.cluster.etcd import Etcd, KeyValue
from agentenv.cluster.membership import NodeRegistration
from agentenv.cluster.mirror import PrefixMirror
from agentenv.contract.runtime import TemplateInfo

CATALOG = "catalog"


def encode(info: TemplateInfo) -> bytes:
    return info.to_json().encode()


def decode(raw: bytes) -> TemplateInfo:
    return TemplateInfo.from_json(raw)


class SharedCatalog:
    """Reads for a control plane; `publish` for a node agent (with its registration). A
    control-plane replica passes `mirrored=True` and starts `mirror`: the reads, which
    placement and template resolution make per create, then answer from it while it is in
    step."""

    def __init__(self, etcd: Etcd, *, mirrored: bool = False) -> None:
        self._etcd = etcd
        self.mirror = PrefixMirror(etcd, etcd.dir(CATALOG), CATALOG) if mirrored else None

    async def _under(self, prefix: bytes) -> list[KeyValue]:
        kvs = self.mirror.under(prefix) if self.mirror is not None else None
        if not kvs:
            # Not known, or none known: an entry a node published a moment ago may not have
            # reached the mirror, and a catalog template is placed only where a node has it.
            kvs, _ = await self._etcd.get_prefix(prefix)
        return kvs

    def _newest(self, kvs: list[KeyValue]) -> dict[str, TemplateInfo]:
        """One entry per name: the newest copy (nodes that imported it at different times)."""
        best: dict[str, TemplateInfo] = {}
        for kv in kvs:
            try:
                info = decode(kv.value)
            except (ValueError, KeyError, TypeError):
                continue  # a record from a newer or broken agent: not ours to read
            seen = best.get(info.name)
            if seen is None or info.updated_at > seen.updated_at:
                best[info.name] = info
        return best

    async def get(self, name: str) -> TemplateInfo | None:
        kvs = await self._under(self._etcd.dir(CATALOG, name))
        return self._newest(kvs).get(name)

    async def holders(self, name: str) -> list[str]:
        prefix = self._etcd.dir(CATALOG, name)
        kvs = await self._under(prefix)
        return sorted(kv.key[len(prefix) :].decode() for kv in kvs)

    async def list(self) -> list[TemplateInfo]:
        kvs = await self._under(self._etcd.dir(CATALOG))
        return sorted(self._newest(kvs).values(), key=lambda t: t.name)

    async def publish(
        self,
        registration: NodeRegistration,
        entries: dict[str, bytes],
        published: dict[str, bytes],
    ) -> dict[str, bytes]:
        """Makes this node's entries `entries` (name → `encode`d), given what it published
        before; returns what is published now."""
        node_id = registration.info.node_id
        now = dict(published)
        for name, value in sorted(entries.items()):
            if published.get(name) != value:
                await registration.hold(self._etcd.key(CATALOG, name, node_id), value)
                now[name] = value
        for name in sorted(set(published) - set(entries)):
            await registration.release(self._etcd.key(CATALOG, name, node_id))
            now.pop(name, None)
        return now
