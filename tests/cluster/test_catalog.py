"""The cluster's catalog: what the nodes publish of their templates, read by any replica."""

from __future__ import annotations

from dataclasses import replace

import pytest

from agentenv.cluster.catalog import SharedCatalog, decode, encode
from agentenv.cluster.etcd import Etcd
from agentenv.cluster.templates import ClusterTemplates
from agentenv.contract.runtime import TemplateInfo, TemplateUnavailable

from .helpers import registered, wait_until

pytestmark = pytest.mark.asyncio(loop_scope="session")

BASE = TemplateInfo(
    name="base",
    size_mb=2048,
    created_at=1.0,
    updated_at=1.0,
    cpu=2,
    memory_mb=512,
    layers=("sha256:" + "a" * 64, "sha256:" + "b" * 64),
    env=(("LANG", "C.UTF-8"), ("PATH", "/usr/bin")),
    user="user",
    workdir="/home/user",
)


class NoTemplates:
    """A replica's own catalog, empty (its data dir holds no template)."""

    async def get(self, name: str) -> TemplateInfo:
        raise TemplateUnavailable(name)

    async def list(self) -> list[TemplateInfo]:
        return []

    async def delete(self, name: str) -> bool:
        return False


async def test_an_entry_round_trips() -> None:
    assert decode(encode(BASE)) == BASE


async def test_what_nodes_publish_a_replica_resolves_and_lists(etcd: Etcd) -> None:
    a = await registered(etcd, "node-a", ttl_s=2)
    b = await registered(etcd, "node-b", ttl_s=2)
    catalog = SharedCatalog(etcd)
    templates = ClusterTemplates(NoTemplates(), catalog)
    try:
        newer = replace(BASE, updated_at=2.0, size_mb=4096)
        at_a = await catalog.publish(a, {"base": encode(BASE)}, {})
        at_b = await catalog.publish(
            b, {"base": encode(newer), "docker": encode(replace(BASE, name="docker"))}, {}
        )
        assert await catalog.holders("base") == ["node-a", "node-b"]
        # The newest copy of a name wins.
        assert (await templates.get("base")).size_mb == 4096
        assert [t.name for t in await templates.list()] == ["base", "docker"]
        # What a node no longer has it withdraws; publishing the same again writes nothing.
        at_b = await catalog.publish(b, {"base": encode(newer)}, at_b)
        assert await catalog.holders("docker") == []
        with pytest.raises(TemplateUnavailable):
            await templates.get("docker")
        assert await catalog.publish(a, {"base": encode(BASE)}, at_a) == at_a
        # A snapshot id no catalog knows goes on to the cluster.
        sid = "0123456789abcdef" * 2
        assert (await templates.get(sid)).name == sid
        # A node that dies takes its entries with it (its lease).
        await b.stop(deregister=False)

        async def only_a() -> bool:
            return await catalog.holders("base") == ["node-a"]

        await wait_until(only_a, timeout_s=2 + 2.0)
        assert (await templates.get("base")).size_mb == 2048
    finally:
        await a.stop()
        await b.stop()
    with pytest.raises(TemplateUnavailable):
        await templates.get("base")
