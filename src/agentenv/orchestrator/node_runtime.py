"""Adapters from this host's ``Node`` and ``TemplateCatalog`` to the orchestrator protocols."""

from __future__ import annotations

from agentenv.config import Settings
from agentenv.orchestrator.errors import BadRequest
from agentenv.orchestrator.node import Node
from agentenv.orchestrator.node_errors import InvalidResources, UnknownSandbox, UnknownTemplate
from agentenv.orchestrator.runtime import (
    Placement,
    TemplateInfo,
    TemplateUnavailable,
    Unsupported,
)
from agentenv.template.catalog import Template, TemplateCatalog, TemplateNotFound


class NodeRuntime:
    def __init__(self, settings: Settings, node: Node | None = None) -> None:
        self.node = node or Node(settings)

    async def start(self) -> None:
        await self.node.start()

    async def close(self) -> None:
        await self.node.close()

    async def create(self, template: str, cpu: int, memory_mb: int, disk_size_mb: int) -> Placement:
        try:
            handle = await self.node.create(template, cpu, memory_mb, disk_size_mb)
        except UnknownTemplate as exc:
            raise TemplateUnavailable(str(exc)) from exc
        except InvalidResources as exc:
            raise BadRequest(str(exc)) from exc
        return Placement(handle.id, handle.address, handle.envd_url)

    async def delete(self, runtime_id: str) -> None:
        try:
            await self.node.delete(runtime_id)
        except UnknownSandbox:
            # Already released (e.g. the VM died and was reaped): nothing left to free.
            return

    async def pause(self, runtime_id: str) -> None:
        raise Unsupported("pause is not available yet: this node cannot snapshot sandboxes")

    async def resume(self, runtime_id: str) -> Placement:
        raise Unsupported("resume is not available yet: this node cannot snapshot sandboxes")

    def is_alive(self, runtime_id: str) -> bool:
        return self.node.is_alive(runtime_id)


class CatalogTemplates:
    """The host's template catalog, seen as ``TemplateInfo`` rows."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.catalog = TemplateCatalog(settings)

    def _info(self, tpl: Template) -> TemplateInfo:
        return TemplateInfo(
            name=tpl.name,
            size_mb=tpl.size_mb,
            created_at=tpl.created_at,
            updated_at=tpl.created_at,
            cpu=self.settings.default_cpu,
            memory_mb=self.settings.default_memory_mb,
        )

    def get(self, name: str) -> TemplateInfo:
        try:
            return self._info(self.catalog.get(name))
        except TemplateNotFound as exc:
            raise TemplateUnavailable(name) from exc

    def list(self) -> list[TemplateInfo]:
        return [self._info(t) for t in self.catalog.list()]

    def delete(self, name: str) -> bool:
        try:
            self.catalog.delete(name)
        except TemplateNotFound:
            return False
        return True
