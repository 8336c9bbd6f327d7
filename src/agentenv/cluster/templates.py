"""Templates as a control-plane replica of a cluster sees them.

Catalog templates (`base`, `docker`, imported images) are what the nodes publish
(`cluster.catalog`): a replica holds none of its own. A replica that has a catalog of its own
(an older deployment that prepared `base` in the replica's home) still finds names there when
no node publishes them. Built templates (`name:tag`) are records every replica shares
(`build.shared_state`, wrapped around this source by `build.templates.BuiltTemplates`).

A snapshot taken on some node (through the API, or a build's) is passed on by id to the
cluster, whose placement prefers the nodes holding it and whose nodes fetch it from object
storage when they lack it; an id no node and no bucket knows is refused there (404), as an
unknown template is here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable

from agentenv.cluster.catalog import SharedCatalog
from agentenv.contract.errors import BadRequest
from agentenv.contract.runtime import (
    ON_DEMAND_TEMPLATES,
    SNAPSHOT_ID,
    TemplateInfo,
    TemplateSource,
    TemplateUnavailable,
)


class ClusterTemplates:
    def __init__(
        self,
        local: TemplateSource,
        catalog: SharedCatalog,
        delete_snapshot: Callable[[str], Awaitable[bool]] | None = None,
    ) -> None:
        self.local = local
        self.catalog = catalog
        # The cluster's: every node's copy and the bucket's.
        self.delete_snapshot = delete_snapshot
        # The wrapped source's settings, where it has them (`api.templates` reads them).
        self.settings: object = getattr(local, "settings", None)

    async def get(self, name: str) -> TemplateInfo:
        real = ON_DEMAND_TEMPLATES.get(name, name)
        found = await self.catalog.get(real)
        if found is not None:
            return found if real == name else dataclasses.replace(found, template_id=real)
        try:
            return await self.local.get(name)
        except TemplateUnavailable:
            if not SNAPSHOT_ID.fullmatch(name):
                raise
        # Its shape is the snapshot's own (a restore keeps it); size, CPUs and memory here
        # are unknown (0): the request's values or the server's defaults are recorded.
        return TemplateInfo(name=name, size_mb=0, created_at=0.0, updated_at=0.0, cpu=0,
                            memory_mb=0)  # fmt: skip

    async def list(self) -> list[TemplateInfo]:
        rows = {t.name: t for t in await self.local.list()}
        rows.update({t.name: t for t in await self.catalog.list()})
        return sorted(rows.values(), key=lambda t: t.name)

    async def delete(self, name: str) -> bool:
        """A snapshot by id: on every node and in the bucket. A catalog template is the
        nodes' (an operator's `aenv` on each node): refused here."""
        if await self.catalog.get(name) is not None:
            raise BadRequest(f"template {name!r} is in the nodes' catalogs; remove it on each node")
        if await self.local.delete(name):
            return True
        if self.delete_snapshot is not None and SNAPSHOT_ID.fullmatch(name):
            return await self.delete_snapshot(name)
        return False


def _check(t: ClusterTemplates) -> TemplateSource:
    return t
