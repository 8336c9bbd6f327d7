"""Adapters from this host's ``Node`` and ``TemplateCatalog`` to the contract's protocols."""

from __future__ import annotations

import asyncio
import contextlib
import errno
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from agentenv import snapshot as snaps
from agentenv.config import Settings
from agentenv.contract.errors import BadRequest, InsufficientStorage, Unavailable
from agentenv.contract.runtime import (
    Found,
    HostMemory,
    Lost,
    Placement,
    SandboxSpec,
    SnapshotInfo,
    TemplateInfo,
    TemplateUnavailable,
    Unsupported,
)
from agentenv.network.egress import Egress
from agentenv.node.errors import (
    BootFailed,
    InvalidResources,
    NoCapacity,
    NotPausable,
    UnknownSandbox,
    UnknownTemplate,
)
from agentenv.node.host import GuestInit, Node, SandboxHandle
from agentenv.snapshot.fork import MAX_CHILDREN
from agentenv.storage import LayerStore, info
from agentenv.template.catalog import Template, TemplateCatalog, TemplateNotFound

# Snapshots made by `POST /sandboxes/{id}/snapshots` (templates and fork captures are not).
_TEMPLATE_SOURCE = "template:"


def snapshot_info(s: snaps.Snapshot) -> SnapshotInfo:
    return SnapshotInfo(s.id, list(s.names), s.source, s.created_at, s.vcpus, s.memory_mb)


# The control plane asks before a pause that needs a live guest; a stuck envd must not hold it.
GUEST_HEALTH_TIMEOUT_S = 3.0


def _init(spec: SandboxSpec) -> GuestInit:
    return GuestInit(dict(spec.env_vars), spec.envd_token)


def _placement(h: SandboxHandle) -> Placement:
    return Placement(h.id, h.address, h.envd_url, booted=h.booted)


def _out_of_space(exc: BaseException) -> bool:
    """ENOSPC anywhere in the chain: an OSError, or a tool's message (qemu-img, QEMU)."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            return True
        if "No space left on device" in str(e):
            return True
        e = e.__cause__ or e.__context__
    return False


@contextlib.contextmanager
def _capacity(data_dir: Path) -> Iterator[None]:
    """A node's refusal (`NoCapacity`) as 503 with its retry hint, a full data dir as 507.
    The node releases what the operation made before either reaches here."""
    try:
        yield
    except NoCapacity as exc:
        raise Unavailable(str(exc), exc.retry_after_s) from exc
    except Exception as exc:
        # A resumed guest that was lost stays lost, whatever filled the disk.
        if isinstance(exc, snaps.ResumedButLost) or not _out_of_space(exc):
            raise
        raise InsufficientStorage(f"no space left in the data dir {data_dir}: {exc}") from exc


class NodeRuntime:
    def __init__(self, settings: Settings, node: Node | None = None) -> None:
        self.node = node or Node(settings)

    async def start(self) -> None:
        await self.node.start()

    async def close(self) -> None:
        await self.node.close()

    async def create(self, spec: SandboxSpec) -> Placement:
        try:
            with _capacity(self.node.settings.home):
                handle = await self.node.create(
                    spec.template,
                    spec.cpu,
                    spec.memory_mb,
                    spec.disk_size_mb,
                    egress=spec.egress,
                    sandbox_id=spec.sandbox_id,
                    init=_init(spec),
                    metadata=spec.metadata,
                )
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

    async def pause(
        self,
        runtime_id: str,
        *,
        memory: bool = True,
        envd_token: str | None = None,
        strict: bool = True,
    ) -> None:
        try:
            with _capacity(self.node.settings.home):
                if memory:
                    await self.node.pause(runtime_id)
                else:
                    await self.node.pause(
                        runtime_id, memory=False, envd_token=envd_token, strict=strict
                    )
        except NotPausable as exc:
            raise Unsupported(str(exc)) from exc
        except snaps.GuestSyncFailed as exc:
            raise Unavailable(
                f"sandbox {runtime_id} was not paused: {exc}; it keeps running"
            ) from exc

    async def resume(self, spec: SandboxSpec, *, memory: bool = True) -> Placement:
        try:
            with _capacity(self.node.settings.home):
                handle = await self.node.resume(spec.sandbox_id, memory=memory, init=_init(spec))
        except snaps.ResumedButLost as exc:
            raise Lost(str(exc)) from exc
        except BootFailed as exc:
            # Paused again as it was (`Node.resume`); the caller may retry.
            raise Unavailable(f"sandbox {spec.sandbox_id} was not resumed: {exc}", 5) from exc
        return _placement(handle)

    async def init_guest(self, spec: SandboxSpec) -> None:
        try:
            await self.node.init_guest(spec.sandbox_id, _init(spec))
        except UnknownSandbox as exc:
            raise Lost(str(exc)) from exc

    async def guest_metrics(self, runtime_id: str, envd_token: str | None) -> dict[str, Any] | None:
        return await self.node.guest_metrics(runtime_id, envd_token)

    async def guest_health(self, runtime_id: str) -> str | None:
        return await self.node.guest_health(runtime_id, GUEST_HEALTH_TIMEOUT_S)

    async def update_egress(self, runtime_id: str, egress: Egress) -> None:
        await self.node.update_egress(runtime_id, egress)

    async def is_alive(self, runtime_id: str) -> bool:
        return self.node.is_alive(runtime_id)

    async def find(self, runtime_id: str) -> Found | None:
        if not self.node.is_alive(runtime_id):
            return None
        sb = self.node.running(runtime_id)
        if sb is not None:
            return Found("running", _placement(sb))
        return Found("paused", None, memory=self.node.paused_memory(runtime_id) is not False)

    async def sandbox_ids(self) -> list[str]:
        return self.node.sandbox_ids()

    async def lost_reason(self, runtime_id: str) -> str | None:
        return self.node.lost.pop(runtime_id, None)

    def watch_lost(self, handler: Callable[[str, str], None]) -> None:
        self.node.on_lost = handler

    async def snapshot(
        self, runtime_id: str, name: str | None, envd_token: str | None, *, memory: bool = True
    ) -> SnapshotInfo:
        try:
            with _capacity(self.node.settings.home):
                if memory:
                    snap = await self.node.snapshot(runtime_id, name, envd_token)
                else:
                    snap = await self.node.snapshot(runtime_id, name, envd_token, memory=False)
        except NotPausable as exc:
            raise Unsupported(str(exc)) from exc
        except snaps.GuestSyncFailed as exc:
            raise Unavailable(f"sandbox {runtime_id} was not snapshotted: {exc}") from exc
        except snaps.InvalidSnapshotName as exc:
            raise BadRequest(str(exc)) from exc
        return snapshot_info(snap)

    async def fork(
        self, runtime_id: str, children: list[SandboxSpec], envd_token: str | None
    ) -> list[Placement]:
        if not 1 <= len(children) <= MAX_CHILDREN:
            raise BadRequest(f"count must be between 1 and {MAX_CHILDREN}")
        try:
            with _capacity(self.node.settings.home):
                made = await self.node.fork(
                    runtime_id,
                    len(children),
                    envd_token,
                    children=[(c.sandbox_id, _init(c)) for c in children],
                )
        except NotPausable as exc:
            raise Unsupported(str(exc)) from exc
        except InvalidResources as exc:
            raise BadRequest(str(exc)) from exc
        return [_placement(h) for h in made]

    def note_activity(self, runtime_id: str) -> None:
        self.node.memory.note_activity(runtime_id)

    async def host_memory(self, runtime_id: str) -> HostMemory | None:
        return self.node.host_memory(runtime_id)

    async def snapshots(self) -> list[SnapshotInfo]:
        listed = await asyncio.to_thread(self.node.repo.list)
        return [
            snapshot_info(s)
            for s in listed
            if s.names and not s.source.startswith(_TEMPLATE_SOURCE)
        ]


class CatalogTemplates:
    """The host's template catalog, seen as ``TemplateInfo`` rows; persistent snapshots are
    templates too (created from by id or name, deleted through `delete`)."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.catalog = TemplateCatalog(settings)
        self.layers = LayerStore(settings.layers_dir)
        self.repo = snaps.SnapshotRepository(settings.home / "snapshots", self.layers)

    def _snapshot(self, ref: str) -> TemplateInfo:
        try:
            s = self.repo.get(ref)
            size = -(-info(self.layers.path(s.top_layer)).virtual_size // (1024 * 1024))
        except (snaps.SnapshotError, Exception) as exc:
            raise TemplateUnavailable(ref) from exc
        return TemplateInfo(ref, size, s.created_at, s.created_at, s.vcpus, s.memory_mb)

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
        except TemplateNotFound:
            return self._snapshot(name)

    def list(self) -> list[TemplateInfo]:
        return [self._info(t) for t in self.catalog.list()]

    def delete(self, name: str) -> bool:
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
