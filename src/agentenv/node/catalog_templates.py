"""The host's template catalog as the contract's `TemplateInfo` rows (`Templates`); persistent
snapshots count as templates. It is also the contract's `SnapshotFiles`: what a single-node
server's control plane (the built templates, tenancy) reads of this host's snapshots, so
it opens no repository of its own. Split from `runtime.py`."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses

from agentenv import snapshot as snaps
from agentenv.config import Settings
from agentenv.contract.runtime import (
    ON_DEMAND_TEMPLATES,
    SnapshotDetails,
    SnapshotFiles,
    TemplateInfo,
    TemplateUnavailable,
    on_demand_info,
)
from agentenv.node.files import snapshots_dir
from agentenv.storage import LayerStore, info
from agentenv.template.catalog import Template, TemplateCatalog, TemplateNotFound

# Snapshots made by `POST /sandboxes/{id}/snapshots` (templates and fork captures are not).


class CatalogTemplates:
    """The host's template catalog, seen as ``TemplateInfo`` rows; persistent snapshots are
    templates too (created from by id or name, deleted through `delete`)."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.catalog = TemplateCatalog(settings)
        self.layers = LayerStore(settings.layers_dir)
        self.repo = snaps.SnapshotRepository(snapshots_dir(settings), self.layers)

    def _snapshot(self, ref: str) -> TemplateInfo:
        try:
            s = self.repo.get(ref)
            size = -(-info(self.layers.path(s.top_layer)).virtual_size // (1024 * 1024))
        except (snaps.SnapshotError, Exception) as exc:
            raise TemplateUnavailable(ref) from exc
        return TemplateInfo(
            ref, size, s.created_at, s.created_at, s.vcpus, s.memory_mb, snapshot_id=s.id
        )

    # -- SnapshotFiles ----------------------------------------------------------------------

    async def details(self, ref: str) -> SnapshotDetails | None:
        return await asyncio.to_thread(self._details, ref)

    def _details(self, ref: str) -> SnapshotDetails | None:
        try:
            s = self.repo.get(ref)
        except snaps.SnapshotError:
            return None
        size = -(-info(self.layers.path(s.top_layer)).virtual_size // (1024 * 1024))
        return SnapshotDetails(s.id, tuple(s.names), s.vcpus, s.memory_mb, s.envd_version, size)

    def snapshot_id(self, name: str) -> str | None:
        try:
            return self.repo.get(name).id
        except snaps.SnapshotError:
            return None

    async def remove_name(self, name: str) -> None:
        with contextlib.suppress(snaps.SnapshotError):
            await asyncio.to_thread(self.repo.remove_name, name)

    def info_of(self, tpl: Template) -> TemplateInfo:
        return self._info(tpl)

    def _info(self, tpl: Template) -> TemplateInfo:
        return TemplateInfo(
            name=tpl.name,
            size_mb=tpl.size_mb,
            created_at=tpl.created_at,
            updated_at=tpl.created_at,
            cpu=self.settings.default_cpu,
            memory_mb=self.settings.default_memory_mb,
            layers=tuple(tpl.layers),
            env=tuple(sorted(tpl.env.items())),
            user=tpl.user,
            workdir=tpl.workdir,
        )

    async def get(self, name: str) -> TemplateInfo:
        return await asyncio.to_thread(self._lookup, name)

    def _lookup(self, name: str) -> TemplateInfo:
        real = ON_DEMAND_TEMPLATES.get(name, name)
        try:
            found = self._info(self.catalog.get(real))
        except TemplateNotFound:
            pending = on_demand_info(name)
            return pending if pending is not None else self._snapshot(name)
        # An alias: its sandboxes report the template it stands for.
        return found if real == name else dataclasses.replace(found, template_id=real)

    def catalog_infos(self) -> list[TemplateInfo]:
        return [self._info(t) for t in self.catalog.list()]

    async def list(self) -> list[TemplateInfo]:
        return await asyncio.to_thread(self.catalog_infos)

    async def delete(self, name: str) -> bool:
        return await asyncio.to_thread(self._delete, name)

    def _delete(self, name: str) -> bool:
        try:
            self.catalog.delete(name)
        except TemplateNotFound:
            pass
        else:
            return True
        try:
            self.repo.delete(name)
        except snaps.SnapshotNotFound:
            return False
        return True


def _check(c: CatalogTemplates) -> SnapshotFiles:
    return c
