"""Adapters from this host's ``Node`` and ``TemplateCatalog`` to the contract's protocols."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

from agentenv import snapshot as snaps
from agentenv.config import Settings
from agentenv.contract.egress import Egress
from agentenv.contract.errors import BadRequest, Conflict, Unavailable
from agentenv.contract.nodes import NodeStatus
from agentenv.contract.runtime import (
    SNAPSHOT_ID,
    Found,
    HostMemory,
    ImportEvent,
    Lost,
    Placement,
    SandboxSpec,
    SnapshotInfo,
    TemplateInfo,
    TemplateUnavailable,
    Unsupported,
)
from agentenv.node.catalog_templates import CatalogTemplates
from agentenv.node.errors import (
    BootFailed,
    InvalidResources,
    NotPausable,
    NotResettable,
    ResetLost,
    UnknownSandbox,
    UnknownTemplate,
)
from agentenv.node.files import sandbox_files
from agentenv.node.host import GuestInit, Node, SandboxHandle
from agentenv.node.host_create import BatchChild
from agentenv.node.ondemand import OnDemandTemplates
from agentenv.node.runtime_guest import GuestCalls
from agentenv.node.runtime_support import LOCAL_NODE, LocalNodes, capacity, host_capacity
from agentenv.objstore import ObjectStore, ObjectStoreError
from agentenv.oci.progress import LayerProgress
from agentenv.snapshot.fork import MAX_CHILDREN
from agentenv.snapshot.pause import DISK
from agentenv.snapshot.remote import RemoteSnapshots
from agentenv.snapshot.remote_cache import CACHE_HOLDER
from agentenv.template.catalog import TemplateNotFound

# Snapshots made by `POST /sandboxes/{id}/snapshots` (templates and fork captures are not).
__all__ = ["TEMPLATE_SOURCE", "CatalogTemplates", "LocalNodes", "NodeRuntime"]

TEMPLATE_SOURCE = "template:"


def snapshot_info(s: snaps.Snapshot) -> SnapshotInfo:
    return SnapshotInfo(s.id, list(s.names), s.source, s.created_at, s.vcpus, s.memory_mb)


# The control plane asks before a pause that needs a live guest; a stuck envd must not hold it.
GUEST_HEALTH_TIMEOUT_S = 3.0


# What `fromImage` builds import images as (`build.templates.image_template_name`).
IMAGE_TEMPLATE_PREFIX = "image-"


def _has_snapshot(repo: snaps.SnapshotRepository, ref: str) -> bool:
    try:
        repo.get(ref)
    except snaps.SnapshotError:
        return False
    return True


def _init(spec: SandboxSpec) -> GuestInit:
    return GuestInit(dict(spec.env_vars), spec.envd_token)


def _placement(h: SandboxHandle) -> Placement:
    return Placement(h.id, h.address, h.envd_url, booted=h.booted)


def _mapped(home: Path, exc: BaseException) -> BaseException:
    """A batch child's failure as `create` would raise it (one error map: `capacity`)."""
    try:
        with capacity(home):
            if isinstance(exc, InvalidResources):
                raise BadRequest(str(exc)) from exc
            raise exc
    except BaseException as mapped:
        return mapped


log = logging.getLogger(__name__)

# Retry-After of a create refused by a cordoned node: an operator's doing, not a moment's load.
CORDONED_RETRY_S = 30


class NodeRuntime(GuestCalls):
    def __init__(self, settings: Settings, node: Node | None = None) -> None:
        self.node = node or Node(settings)
        # Cordoned (the in-process node's own directory): creates and resumes are refused.
        self.cordon_reason: str | None = None
        # Told of a reset before the guest is swapped (a node agent's data gateway cuts the
        # sandbox's tunnels: the same address will be another guest).
        self.on_reset: Callable[[str], None] | None = None
        # Paused sandboxes in object storage (`snapshot.remote`), when a bucket is set: a
        # pause uploads, a resume of one this node lacks downloads, so any node resumes it.
        self.objects: ObjectStore | None = None
        self.remote: RemoteSnapshots | None = None
        # Called after the catalog changed here (an image imported or removed): a node agent
        # republishes it before the call answers, so the cluster places the build sandbox
        # here (or no longer resolves the removed one).
        self.after_import: Callable[[], Awaitable[None]] | None = None
        # Templates built on their first create (code-interpreter-v1).
        self.on_demand = OnDemandTemplates(self.node.settings, self._catalog_changed)

    async def _catalog_changed(self) -> None:
        if self.after_import is not None:
            await self.after_import()

    def status(self, node_id: str = LOCAL_NODE, rpc_url: str = "", version: str = "") -> NodeStatus:
        """This node as `GET /nodes` shows it, and as an agent publishes its load."""
        free_mb, free_slots = self.node.admission.headroom()
        ids = self.node.sandbox_ids()
        running = sum(1 for sb in self.node.list() if not sb.paused)
        cpus, memory_mb = host_capacity()
        return NodeStatus(
            node_id=node_id,
            state="cordoned" if self.cordon_reason is not None else "ready",
            rpc_url=rpc_url,
            version=version,
            cpus=cpus,
            memory_mb=memory_mb,
            slots=self.node.settings.network.max_slots,
            free_memory_mb=free_mb,
            free_slots=free_slots,
            running=running,
            paused=max(0, len(ids) - running),
            updated_at=time.time(),
            cordon_reason=self.cordon_reason or "",
        )

    async def start(self) -> None:
        await self.node.start()
        settings = self.node.settings
        objects = ObjectStore.from_settings(settings)
        if objects is not None:
            try:
                await objects.ensure_bucket()
                self.remote = RemoteSnapshots.from_settings(settings, objects)
                await asyncio.to_thread(self.remote.cleanup_partials)
            except BaseException:
                await objects.close()
                await self.node.close()
                raise
            self.objects = objects

    async def close(self) -> None:
        await self.on_demand.close()
        await self.node.close()
        if self.objects is not None:
            await self.objects.close()
            self.objects = self.remote = None

    async def _push_paused(self, sandbox_id: str) -> None:
        """Upload what a pause left, so another node can resume it. A failed upload leaves
        the sandbox paused here (it resumes on this node only), and says so in the log."""
        if self.remote is None:
            return
        try:
            # A RAM stream is converted to its mapped file first: that is what travels.
            await self.node.conversions.settle(sandbox_id)
            await self.remote.push_paused(
                sandbox_files(self.node.settings, sandbox_id).workdir, sandbox_id
            )
        except Exception as exc:
            log.error("sandbox %s: paused, but not uploaded (%s); it resumes here only",
                      sandbox_id, exc)  # fmt: skip

    async def _fetch_paused(self, sandbox_id: str) -> None:
        """A sandbox paused on another node: its files from object storage, first."""
        if self.node.is_alive(sandbox_id):
            return
        if self.remote is None:
            raise Unavailable(
                f"sandbox {sandbox_id} is not on this node, and without object storage "
                "(AGENTENV_S3_*) it cannot be fetched",
                CORDONED_RETRY_S,
            )
        try:
            await self.remote.pull_paused(
                sandbox_id, sandbox_files(self.node.settings, sandbox_id).workdir
            )
        except (snaps.SnapshotError, ObjectStoreError) as exc:
            raise Unavailable(
                f"sandbox {sandbox_id} is not on this node and could not be fetched from "
                f"object storage: {exc}",
                CORDONED_RETRY_S,
            ) from exc

    async def _drop_remote(self, sandbox_id: str) -> None:
        if self.remote is None:
            return
        try:
            await self.remote.delete_paused(sandbox_id)
        except Exception as exc:
            log.warning("sandbox %s: its copy in object storage was not deleted: %s",
                        sandbox_id, exc)  # fmt: skip

    def _refuse_if_cordoned(self, what: str) -> None:
        if self.cordon_reason is not None:
            raise Unavailable(
                f"{what} refused: this node is cordoned ({self.cordon_reason}) and takes no "
                "new sandboxes",
                CORDONED_RETRY_S,
            )

    async def create(self, spec: SandboxSpec) -> Placement:
        self._refuse_if_cordoned(f"create of {spec.sandbox_id}")
        template = await self.on_demand.resolve(spec.template)
        await self._fetch_snapshot(template)
        try:
            with capacity(self.node.settings.home):
                handle = await self.node.create(
                    template,
                    spec.cpu,
                    spec.memory_mb,
                    spec.disk_size_mb,
                    egress=spec.egress,
                    sandbox_id=spec.sandbox_id,
                    init=_init(spec),
                    metadata=spec.metadata,
                    capacity_wait_s=spec.capacity_wait_s,
                )
        except UnknownTemplate as exc:
            raise TemplateUnavailable(str(exc)) from exc
        except InvalidResources as exc:
            raise BadRequest(str(exc)) from exc
        return Placement(handle.id, handle.address, handle.envd_url)

    async def reset(self, spec: SandboxSpec) -> Placement:
        # Not refused on a cordoned node: a reset in place takes nothing new here (same
        # slot, same place kept), and an RL rollout's resets go on while the node drains.
        if self.on_reset is not None:
            self.on_reset(spec.sandbox_id)
        template = await self.on_demand.resolve(spec.template)
        await self._fetch_snapshot(template)
        try:
            with capacity(self.node.settings.home):
                handle = await self.node.reset(spec.sandbox_id, template, init=_init(spec))
        except ResetLost as exc:
            raise Lost(str(exc)) from exc
        except NotResettable as exc:
            raise Unsupported(str(exc)) from exc
        except UnknownTemplate as exc:
            raise TemplateUnavailable(str(exc)) from exc
        except InvalidResources as exc:
            raise BadRequest(str(exc)) from exc
        return Placement(handle.id, handle.address, handle.envd_url)

    async def create_many(self, specs: Sequence[SandboxSpec]) -> list[Placement | BaseException]:
        """Sandboxes of one named snapshot (a snapshot's fork) start as one batch on the node
        (`Node.create_batch`); anything else is one create each, concurrently."""
        if not specs or len({s.template for s in specs}) != 1:
            return list(await asyncio.gather(*map(self.create, specs), return_exceptions=True))
        first = specs[0]
        self._refuse_if_cordoned(f"{len(specs)} creates of {first.template}")
        template = await self.on_demand.resolve(first.template)
        await self._fetch_snapshot(template)
        children = [BatchChild(s.sandbox_id, s.egress, _init(s), s.metadata) for s in specs]
        try:
            with capacity(self.node.settings.home):
                handles = await self.node.create_batch(
                    template, children, capacity_wait_s=first.capacity_wait_s
                )
        except InvalidResources as exc:
            raise BadRequest(str(exc)) from exc
        if handles is None:
            return list(await asyncio.gather(*map(self.create, specs), return_exceptions=True))
        home = self.node.settings.home
        return [
            _mapped(home, h) if isinstance(h, BaseException) else _placement(h) for h in handles
        ]

    async def _fetch_snapshot(self, ref: str) -> None:
        """A create from a snapshot (a built template's, or one taken through the API) that
        another node captured: fetched from object storage first (by id: names are each
        node's own). Nothing to do for templates and snapshots this node has."""
        if self.remote is None or not SNAPSHOT_ID.fullmatch(ref):
            return
        if await asyncio.to_thread(_has_snapshot, self.node.repo, ref):
            return
        try:
            if await self.remote.exists(ref):
                await self.remote.pull(ref)
        except (snaps.SnapshotError, ObjectStoreError) as exc:
            raise Unavailable(
                f"snapshot {ref[:12]} is not on this node and could not be fetched from "
                f"object storage: {exc}",
                CORDONED_RETRY_S,
            ) from exc

    async def delete(self, sandbox_id: str) -> None:
        await self.forget(sandbox_id)
        await self._drop_remote(sandbox_id)

    async def forget(self, sandbox_id: str) -> None:
        try:
            await self.node.delete(sandbox_id)
        except UnknownSandbox:
            # Already released (e.g. the VM died and was reaped): nothing left to free.
            return

    async def pause(
        self,
        sandbox_id: str,
        *,
        memory: bool = True,
        envd_token: str | None = None,
        strict: bool = True,
    ) -> None:
        try:
            with capacity(self.node.settings.home):
                if memory:
                    await self.node.pause(sandbox_id)
                else:
                    await self.node.pause(
                        sandbox_id, memory=False, envd_token=envd_token, strict=strict
                    )
        except NotPausable as exc:
            raise Unsupported(str(exc)) from exc
        except snaps.GuestSyncFailed as exc:
            raise Unavailable(
                f"sandbox {sandbox_id} was not paused: {exc}; it keeps running"
            ) from exc
        await self._push_paused(sandbox_id)

    async def resume(self, spec: SandboxSpec, *, memory: bool = True) -> Placement:
        self._refuse_if_cordoned(f"resume of {spec.sandbox_id}")
        await self._fetch_paused(spec.sandbox_id)
        try:
            with capacity(self.node.settings.home):
                handle = await self.node.resume(spec.sandbox_id, memory=memory, init=_init(spec))
        except snaps.ResumedButLost as exc:
            raise Lost(str(exc)) from exc
        except BootFailed as exc:
            # Paused again as it was (`Node.resume`); the caller may retry.
            raise Unavailable(f"sandbox {spec.sandbox_id} was not resumed: {exc}", 5) from exc
        # It runs here now: a stale copy in the bucket must not be resumed anywhere else.
        await self._drop_remote(spec.sandbox_id)
        return _placement(handle)

    async def init_guest(self, spec: SandboxSpec) -> None:
        try:
            await self.node.init_guest(spec.sandbox_id, _init(spec))
        except UnknownSandbox as exc:
            raise Lost(str(exc)) from exc

    async def guest_metrics(self, sandbox_id: str, envd_token: str | None) -> dict[str, Any] | None:
        return await self.node.guest_metrics(sandbox_id, envd_token)

    async def guest_health(self, sandbox_id: str) -> str | None:
        return await self.node.guest_health(sandbox_id, GUEST_HEALTH_TIMEOUT_S)

    async def update_egress(self, sandbox_id: str, egress: Egress) -> None:
        await self.node.update_egress(sandbox_id, egress)

    async def is_alive(self, sandbox_id: str) -> bool:
        return self.node.is_alive(sandbox_id)

    async def find(self, sandbox_id: str) -> Found | None:
        if not self.node.is_alive(sandbox_id):
            return await self._find_in_bucket(sandbox_id)
        sb = self.node.running(sandbox_id)
        if sb is not None:
            return Found("running", _placement(sb))
        return Found("paused", None, memory=self.node.paused_memory(sandbox_id) is not False)

    async def _find_in_bucket(self, sandbox_id: str) -> Found | None:
        """Paused, with its files only in the bucket (this node's disk was replaced, say): a
        resume here fetches it, so it is held, not lost. A bucket that does not answer says
        nothing (None, logged): as if there were no bucket."""
        if self.remote is None:
            return None
        try:
            kind = await self.remote.paused_kind(sandbox_id)
        except ObjectStoreError as exc:
            log.warning("sandbox %s: the bucket was not asked for it: %s", sandbox_id, exc)
            return None
        return None if kind is None else Found("paused", None, memory=kind != DISK)

    async def sandbox_ids(self) -> list[str]:
        return self.node.sandbox_ids()

    async def lost_reason(self, sandbox_id: str) -> str | None:
        return self.node.lost.pop(sandbox_id, None)

    def watch_lost(self, handler: Callable[[str, str], None]) -> None:
        self.node.on_lost = handler

    async def snapshot(
        self, sandbox_id: str, name: str | None, envd_token: str | None, *, memory: bool = True
    ) -> SnapshotInfo:
        try:
            with capacity(self.node.settings.home):
                if memory:
                    snap = await self.node.snapshot(sandbox_id, name, envd_token)
                else:
                    snap = await self.node.snapshot(sandbox_id, name, envd_token, memory=False)
        except NotPausable as exc:
            raise Unsupported(str(exc)) from exc
        except snaps.GuestSyncFailed as exc:
            raise Unavailable(f"sandbox {sandbox_id} was not snapshotted: {exc}") from exc
        except snaps.InvalidSnapshotName as exc:
            raise BadRequest(str(exc)) from exc
        if self.remote is not None:
            # Any node may be asked to create from it: it goes to object storage now, while
            # its files are certainly here. If that fails, creates from it work here only.
            try:
                await self.remote.push(snap.id)
            except Exception as exc:
                log.error("snapshot %s: not uploaded (%s); creates from it work on this node "
                          "only", snap.id[:12], exc)  # fmt: skip
        return snapshot_info(snap)

    async def fork(
        self, sandbox_id: str, children: list[SandboxSpec], envd_token: str | None
    ) -> list[Placement]:
        if not 1 <= len(children) <= MAX_CHILDREN:
            raise BadRequest(f"count must be between 1 and {MAX_CHILDREN}")
        if self.node.running(sandbox_id) is None:
            # A paused source may have been paused on another node: fetched as a resume would.
            await self._fetch_paused(sandbox_id)
        try:
            with capacity(self.node.settings.home):
                made = await self.node.fork(
                    sandbox_id,
                    len(children),
                    envd_token,
                    children=[(c.sandbox_id, _init(c)) for c in children],
                )
        except NotPausable as exc:
            raise Unsupported(str(exc)) from exc
        except InvalidResources as exc:
            raise BadRequest(str(exc)) from exc
        except (snaps.NoMemory, snaps.IncompatibleSnapshot) as exc:
            # A paused source that kept no memory, or whose state this host cannot load.
            raise Conflict(str(exc)) from exc
        # Each child's origin is the capture it was restored from: its reset goes back there.
        return [
            dataclasses.replace(_placement(h), origin=h.machine.snapshot_id if h.machine else None)
            for h in made
        ]

    async def gateway(self, node_id: str) -> str | None:
        """Guests of this node are reached at their slot addresses."""
        return None

    def note_activity(self, sandbox_id: str) -> None:
        self.node.memory.note_activity(sandbox_id)

    async def host_memory(self, sandbox_id: str) -> HostMemory | None:
        return await self.node.host_memory(sandbox_id)

    async def snapshots(self) -> list[SnapshotInfo]:
        listed = await asyncio.to_thread(self.node.repo.list)
        return [
            snapshot_info(s) for s in listed if s.names and not s.source.startswith(TEMPLATE_SOURCE)
        ]

    async def import_image(
        self,
        ref: str,
        name: str,
        credentials: tuple[str, str] | None,
        on_event: Callable[[ImportEvent], None],
    ) -> TemplateInfo:
        from agentenv.template.image import import_image  # the OCI stack, only when used

        def on_layer(p: LayerProgress) -> None:
            on_event(ImportEvent(layer=dataclasses.asdict(p)))

        tpl = await import_image(
            self.node.settings,
            ref,
            name=name,
            credentials=credentials,
            log=lambda line: on_event(ImportEvent(message=line)),
            layer_progress=on_layer,
        )
        if self.after_import is not None:
            try:
                await self.after_import()
            except Exception as exc:
                log.warning("template %s: catalog not republished after import: %s", name, exc)
        return CatalogTemplates(self.node.settings).info_of(tpl)

    async def remove_image(self, name: str) -> bool:
        from agentenv.template.image import remove_template  # the OCI stack, only when used

        if not name.startswith(IMAGE_TEMPLATE_PREFIX):
            raise BadRequest(
                f"template {name!r} is not an imported image ({IMAGE_TEMPLATE_PREFIX}…)"
            )
        try:
            await asyncio.to_thread(remove_template, self.node.settings, name)
        except TemplateNotFound:
            return False
        if self.after_import is not None:
            try:
                await self.after_import()
            except Exception as exc:
                log.warning("template %s: catalog not republished after removal: %s", name, exc)
        return True

    async def delete_snapshot(self, snapshot_id: str) -> bool:
        """This node's copy and the bucket's (any node deleting it deletes it for all)."""
        if not SNAPSHOT_ID.fullmatch(snapshot_id):
            raise BadRequest(f"snapshot id {snapshot_id!r}: expected 32 hex digits")
        found = False
        try:
            # A copy pulled from the bucket is held by the pull cache only: that is no reason
            # to keep it. A sandbox mapping its memory keeps it until it ends (`repo.gc`).
            await asyncio.to_thread(self.node.repo.unref, snapshot_id, CACHE_HOLDER)
            await asyncio.to_thread(self.node.repo.delete, snapshot_id)
            found = True
        except snaps.SnapshotNotFound:
            pass
        if self.remote is not None:
            try:
                found = await self.remote.delete(snapshot_id) or found
            except ObjectStoreError as exc:
                raise Unavailable(f"snapshot {snapshot_id}: the bucket's copy: {exc}") from exc
        return found
