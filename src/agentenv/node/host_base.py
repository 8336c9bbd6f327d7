"""The node's state and what every path shares: queries, validation, the guest's envd calls,
sandbox records, delete and release. Split from `host.py`."""

from __future__ import annotations

import asyncio
import builtins
import json
import logging
import os
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

from agentenv import snapshot as snaps
from agentenv.cleanup import Cleanup, CleanupFailed
from agentenv.config import Settings
from agentenv.contract.ids import new_sandbox_id
from agentenv.contract.runtime import HostMemory
from agentenv.faults import crash_point
from agentenv.files import PAUSED
from agentenv.guest.envd.client import EnvdClient, EnvdError
from agentenv.network import Egress, SlotPool
from agentenv.network.dns import DnsForwarder
from agentenv.node import cleanup as node_cleanup
from agentenv.node.admission import Admission, Limits
from agentenv.node.conversions import PausedConversions
from agentenv.node.errors import (
    BootFailed,
    CpuOutOfRange,
    DiskTooSmallForTemplate,
    MemoryOutOfRange,
    NotPausable,
    SandboxError,
    SandboxPaused,
    UnknownSandbox,
    UnknownTemplate,
)
from agentenv.node.files import SandboxFiles, sandbox_files, snapshots_dir
from agentenv.node.memory import MemoryManager, MemoryPolicy, PssCache
from agentenv.node.sandbox import (
    HEALTH_POLL_S,
    HEALTH_REQUEST_TIMEOUT_S,
    Boot,
    GuestInit,
    SandboxHandle,
    TemplateDefaults,
    defaults_of,
    replace_json,
    tail,
)
from agentenv.node.warm import SNAPSHOT_PREFIX, Shape, WarmPool
from agentenv.snapshot import GuestImage, Machine, Snapshot, SnapshotError
from agentenv.snapshot.identity import ENTROPY_BYTES
from agentenv.snapshot.pause import DISK
from agentenv.snapshot.restore import (
    Prepared,
    discard,
    prepare,
)
from agentenv.storage import (
    LayerStore,
    info,
)
from agentenv.vmm.accel import AccelChoice
from agentenv.vmm.qemu import QemuVM

log = logging.getLogger(__name__)

WARM_ENTRY = "warm entry"


class NodeBase:
    """State of a `host.Node` and the steps its create, pause and recovery paths share."""

    def __init__(
        self, settings: Settings, *, mem_file: bool = False, snapshots: bool | None = None
    ) -> None:
        self.settings = settings
        self.snapshots = settings.snapshots if snapshots is None else snapshots
        # Snapshots need guest RAM in a file (pause saves only device state over it).
        self.mem_file = mem_file or self.snapshots
        self.layers = LayerStore(settings.layers_dir)
        self.repo = snaps.SnapshotRepository(snapshots_dir(settings), self.layers)
        self.pool = SlotPool(
            settings.network,
            settings.slot_pool_low,
            settings.slot_pool_high,
            owner=settings.slots_dir,
            # The resolver guests are given (the slot gateway) forwards to these.
            dns=DnsForwarder(settings.dns),
        )
        self._sandboxes: dict[str, SandboxHandle] = {}
        self._pss = PssCache()
        # Sandboxes found dead or not adoptable at start: why (the control plane takes each
        # once, `NodeRuntime.lost_reason`).
        self.lost: dict[str, str] = {}
        # Sandboxes lost in the middle of a reset whose target (a fork's capture) is kept
        # for the control plane's restart under `RESET_HOLDER + id` (`host_reset`); the
        # next create or delete of that id lets it go.
        self._reset_holds: set[str] = set()
        # Told (sandbox id, why) the moment a running sandbox's VM ends on its own; without
        # a handler the node deletes the sandbox itself.
        self.on_lost: Callable[[str, str], None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        # Held while this node runs: the node that gets it owns what a dead one left.
        self._owner_fd: int | None = None
        # Every start (create, resume, fork) is admitted first: capacity, then a FIFO turn.
        self.admission = Admission(
            Limits.from_settings(settings),
            lambda: [sb for sb in self._sandboxes.values() if not sb.paused],
            settings.home,
        )
        self.warm = WarmPool(
            settings.warm_low if self.snapshots else 0,
            settings.warm_high if self.snapshots else 0,
            self._warm_make,
            self._warm_drop,
            self._warm_current,
            max_entries=settings.warm_max,
        )
        # This node's warm entries (`<warm_dir>/<pid>-<random>/<sandbox id>`), made at start,
        # and each waiting entry's stack by its name (a create that takes one forgets it).
        self._warm_stacks: dict[str, Cleanup] = {}
        self._warm_root: Path | None = None
        self._accel: AccelChoice | None = None
        self._layer_mb: dict[str, int] = {}
        self._boot: Boot | None = None
        self._image: GuestImage | None = None
        # Balloons of idle sandboxes (node.memory); captures hold it off a sandbox.
        # Paused sandboxes' RAM streams become memory files of their own in the background.
        self.conversions = PausedConversions(lambda: self.image)
        self.memory = MemoryManager(
            self.list,
            MemoryPolicy(
                idle_s=settings.idle_reclaim_s,
                floor_mb=settings.balloon_floor_mb,
                pressure_pct=settings.memory_pressure_pct,
            ),
        )

    @property
    def accel(self) -> AccelChoice:
        if self._accel is None:
            raise SandboxError("node is not started")
        return self._accel

    def _vm_exited(self, vm: QemuVM) -> None:
        """A QEMU ended without being asked to (crashed, killed from outside). Called by
        its watcher at once; the sandbox it ran is lost, a warm entry is replaced."""
        sb = self._sandboxes.get(vm.name)
        if sb is not None and sb.vm is vm and not sb.paused:
            why = f"its VM ended unexpectedly (exit status {vm.exit_code}): {tail(vm.serial_log)}"
            if self.on_lost is not None:
                self.on_lost(sb.id, why)
            else:
                self._background(self.delete(sb.id), f"delete-lost-{sb.id}")
            return
        self.warm.evict(vm.name)

    def _background(self, coro: Awaitable[None], name: str) -> None:
        async def run() -> None:
            try:
                await coro
            except Exception:
                log.exception("%s failed", name)

        task = asyncio.create_task(run(), name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    @property
    def image(self) -> GuestImage:
        if self._image is None:
            raise SandboxError("node is not started")
        return self._image

    def get(self, sandbox_id: str) -> SandboxHandle:
        try:
            return self._sandboxes[sandbox_id]
        except KeyError:
            raise UnknownSandbox(f"sandbox {sandbox_id!r} does not exist") from None

    def running(self, sandbox_id: str) -> SandboxHandle | None:
        """The handle of a sandbox that runs here (not paused), else None."""
        sb = self._sandboxes.get(sandbox_id)
        return None if sb is None or sb.paused else sb

    def list(self) -> list[SandboxHandle]:
        return list(self._sandboxes.values())

    def is_alive(self, sandbox_id: str) -> bool:
        """Running here, or paused (in memory or on disk from an earlier node)."""
        sb = self._sandboxes.get(sandbox_id)
        if sb is not None and not sb.paused:
            return sb.vm.pid is not None and sb.vm.exit_code is None
        return self._paused_on_disk(sandbox_id)

    async def host_memory(self, sandbox_id: str) -> HostMemory | None:
        """What the sandbox's QEMU holds on the host (PSS, up to `PSS_FRESH_S` old), None
        unless it runs."""
        sb = self._sandboxes.get(sandbox_id)
        pid = None if sb is None or sb.paused else sb.vm.pid
        return None if pid is None else await self._pss.read(sandbox_id, pid)

    def paused_memory(self, sandbox_id: str) -> bool | None:
        """Whether a paused sandbox kept its memory (False: a filesystem-only pause, no RAM
        file on disk, resumed by a cold boot); None unless it is paused."""
        if self.running(sandbox_id) is not None or not self._paused_on_disk(sandbox_id):
            return None
        try:
            record = snaps.paused_state(sandbox_files(self.settings, sandbox_id).workdir)
        except SnapshotError:
            return None
        return None if record is None else record.kind != DISK

    def _on_disk(self, sandbox_id: str, what: str = "") -> bool:
        if "/" in sandbox_id or sandbox_id in ("", ".", ".."):
            return False
        return sandbox_files(self.settings, sandbox_id).file(what).exists()

    def _paused_on_disk(self, sandbox_id: str) -> bool:
        return self._on_disk(sandbox_id, PAUSED)

    def sandbox_ids(self) -> builtins.list[str]:
        """Every sandbox this node holds: running ones and those paused on disk."""
        ids = {sb.id for sb in self._sandboxes.values() if not sb.paused}
        if self.settings.sandboxes_dir.is_dir():
            ids |= {p.name for p in self.settings.sandboxes_dir.iterdir() if (p / PAUSED).is_file()}
        return sorted(ids)

    # -- create / delete --------------------------------------------------------------------

    def _validate(
        self, template: str, cpu: int, memory_mb: int, disk_size_mb: int | None
    ) -> tuple[str, Path, int, int, TemplateDefaults]:
        s = self.settings
        if not 1 <= cpu <= s.max_cpu:
            raise CpuOutOfRange(f"cpu must be between 1 and {s.max_cpu}, got {cpu}")
        if memory_mb < s.min_memory_mb:
            raise MemoryOutOfRange(
                f"memory {memory_mb} MB is below the guest minimum of {s.min_memory_mb} MB"
            )
        if memory_mb > s.max_memory_mb:
            raise MemoryOutOfRange(f"memory {memory_mb} MB is above the {s.max_memory_mb} MB limit")
        from agentenv.template.catalog import TemplateCatalog, TemplateNotFound

        try:
            tpl = TemplateCatalog(s).get(template)
        except TemplateNotFound as exc:
            raise UnknownTemplate(f"template {template!r} does not exist") from exc
        if not tpl.layers:
            raise UnknownTemplate(f"template {template!r} has no layers")
        top = tpl.layers[-1]
        top_path = self.layers.path(top)
        base_mb = self._layer_mb.get(top)
        if base_mb is None:
            # Layers are content-addressed and immutable: one `qemu-img info` per layer, not
            # one per create.
            base_mb = self._layer_mb[top] = -(-info(top_path).virtual_size // (1024 * 1024))
        if disk_size_mb is not None and disk_size_mb < base_mb:
            raise DiskTooSmallForTemplate(
                f"disk of {disk_size_mb} MB is smaller than template {template!r} ({base_mb} MB)"
            )
        return top, top_path, disk_size_mb or base_mb, base_mb, TemplateDefaults.of(tpl)

    async def _wait_healthy(self, sb: SandboxHandle) -> None:
        def exited() -> str | None:
            code = sb.vm.exit_code
            return None if code is None else f"VM exited with {code} during boot"

        async with EnvdClient(sb.envd_url, timeout=HEALTH_REQUEST_TIMEOUT_S) as envd:
            try:
                await envd.wait_healthy(
                    self.image.boot_timeout_s,
                    HEALTH_POLL_S,
                    probe_s=HEALTH_REQUEST_TIMEOUT_S,
                    gone=exited,
                )
            except EnvdError as exc:
                raise BootFailed(
                    f"sandbox {sb.id}: {exc.message}; console: {tail(sb.serial_log)}"
                ) from exc

    async def delete(self, sandbox_id: str) -> None:
        """Run the sandbox's cleanup stack (`node.cleanup`): the one its create, resume or
        fork built, or, for one that runs nowhere (paused, or left of one lost while
        resuming), the one its files record."""
        sb = self._sandboxes.pop(sandbox_id, None)
        self.memory.forget(sandbox_id)
        await self.conversions.cancel(sandbox_id)
        if sandbox_id in self._reset_holds:
            self._reset_holds.discard(sandbox_id)
            await asyncio.to_thread(node_cleanup.drop_reset_hold, self.repo, sandbox_id)
        if sb is not None:
            stack = sb.cleanup
        elif self._on_disk(sandbox_id):
            stack = self._stack_on_disk(sandbox_id)
        else:
            raise UnknownSandbox(f"sandbox {sandbox_id!r} does not exist")
        try:
            await stack.run(_after_delete_step)
        except CleanupFailed as exc:
            raise SandboxError(str(exc)) from exc

    def _stack_on_disk(self, sandbox_id: str) -> Cleanup:
        workdir = sandbox_files(self.settings, sandbox_id).workdir
        return node_cleanup.on_disk(sandbox_id, workdir, self.layers, self.repo)

    async def _unwind(self, stack: Cleanup, what: str) -> None:
        """Run the stack of a start that failed; its own failures are logged (the start's
        error is the one the caller sees)."""
        try:
            await stack.run()
        except CleanupFailed as exc:
            log.error("after %s: %s", what, exc)

    # -- snapshots --------------------------------------------------------------------------

    def _named_snapshot(self, ref: str) -> Snapshot | None:
        """A snapshot created through the API (`POST /sandboxes/{id}/snapshots`), by name or
        id; template names win over snapshot names."""
        if not self.snapshots:
            return None
        from agentenv.template.catalog import TemplateCatalog, TemplateNotFound

        try:
            TemplateCatalog(self.settings).get(ref)
            return None
        except TemplateNotFound:
            pass
        try:
            return self.repo.get(ref)
        except SnapshotError:
            return None

    async def _template_snapshot(self, template: str, cpu: int, memory_mb: int) -> Snapshot | None:
        try:
            return await snaps.ensure_template_snapshot(
                self.settings, template, memory_mb, cpu, self.image
            )
        except Exception as exc:
            log.warning("template %s: no snapshot (%s); cold boot instead", template, exc)
            return None

    async def _write_meta(
        self,
        workdir: Path,
        template: str,
        cpu: int,
        memory_mb: int,
        disk_mb: int,
        top: str,
        egress: Egress,
        defaults: TemplateDefaults | None = None,
        metadata: Mapping[str, str] | None = None,
    ) -> None:
        meta: dict[str, object] = {
            "template": template,
            "cpu": cpu,
            "memory_mb": memory_mb,
            "disk_size_mb": disk_mb,
            "top_layer": top,
            "egress": egress.to_json(),
        }
        if defaults is not None and defaults.any:
            # A boot from this disk later (filesystem-only resume) needs them again, also if
            # the template has been replaced or deleted by then.
            meta["defaults"] = {"env": defaults.env, "user": defaults.user,
                                "workdir": defaults.workdir}  # fmt: skip
        if metadata:
            meta["metadata"] = dict(metadata)
        await asyncio.to_thread(replace_json, SandboxFiles(workdir).meta, meta)

    async def _init_booted(
        self, handle: SandboxHandle, defaults: TemplateDefaults | None, init: GuestInit
    ) -> None:
        """A cold-booted guest's envd knows nothing yet (its hostname came on the kernel
        command line): its one `/init` carries the clock, entropy, the template's defaults
        and `init` (a restored guest gets the same with its identity, `_restore`)."""
        d = defaults or TemplateDefaults()
        env = init.env_over(d)
        try:
            # A fresh envd ignores the header; one that has the token (a start cut short
            # after its `/init`, given it again) needs it.
            async with EnvdClient(handle.envd_url, init.envd_token) as envd:
                await envd.init(
                    env_vars=env or None,
                    access_token=init.envd_token,
                    default_user=d.user,
                    default_workdir=d.workdir,
                    entropy=os.urandom(ENTROPY_BYTES),
                )
        except EnvdError as exc:
            raise BootFailed(f"sandbox {handle.id}: envd refused its /init: {exc}") from exc
        handle.envd_token = init.envd_token

    async def init_guest(self, sandbox_id: str, init: GuestInit) -> None:
        """The full `/init` of a create again, for a running sandbox (`Runtime.init_guest`)."""
        sb = self.get(sandbox_id)
        if sb.paused:
            raise SandboxPaused(f"sandbox {sandbox_id} is paused")
        meta = await asyncio.to_thread(SandboxFiles(sb.workdir).meta.read_text)
        await self._init_booted(sb, defaults_of(json.loads(meta)), init)

    async def guest_metrics(self, sandbox_id: str, envd_token: str | None) -> dict[str, Any] | None:
        """envd's current `/metrics` sample of a running sandbox, None when it cannot say."""
        sb = self._sandboxes.get(sandbox_id)
        if sb is None or sb.paused:
            return None
        try:
            async with EnvdClient(sb.envd_url, envd_token, timeout=5.0) as envd:
                return await envd.metrics()
        except (EnvdError, ValueError) as exc:
            log.info("sandbox %s metrics unavailable: %r", sandbox_id, exc)
            return None

    async def reinit(self, sandbox_id: str) -> None:
        """After a resume with its memory: the guest's clock stood still while it was paused
        and its RNG state is the one it was saved with."""
        sb = self.get(sandbox_id)
        async with EnvdClient(sb.envd_url, sb.envd_token) as envd:
            await envd.init(entropy=os.urandom(ENTROPY_BYTES))

    async def guest_health(self, sandbox_id: str, timeout_s: float) -> str | None:
        """Why the running sandbox's envd does not answer `/health`, None when it does."""
        sb = self._sandboxes.get(sandbox_id)
        if sb is None or sb.paused:
            return "not running"
        async with EnvdClient(sb.envd_url, timeout=timeout_s) as envd:
            return await envd.unhealthy(timeout_s)

    async def update_egress(self, sandbox_id: str, egress: Egress) -> None:
        """Replace a sandbox's egress policy: at once while it runs (on its slot), from its
        next resume while it is paused."""
        sb = self._sandboxes.get(sandbox_id)
        if (sb is None or sb.paused) and not self._paused_on_disk(sandbox_id):
            raise UnknownSandbox(f"sandbox {sandbox_id!r} does not exist")
        workdir = sandbox_files(self.settings, sandbox_id).workdir
        if sb is not None and not sb.paused:
            await self.pool.set_egress(sb.slot, egress, running=True)
            sb.egress = egress

        def rewrite() -> None:
            meta = json.loads(SandboxFiles(workdir).meta.read_text())
            meta["egress"] = egress.to_json()
            replace_json(SandboxFiles(workdir).meta, meta)

        await asyncio.to_thread(rewrite)

    async def _warm_current(self, shape: Shape) -> str | None:
        from agentenv.template.catalog import TemplateNotFound

        if shape.template.startswith(SNAPSHOT_PREFIX):
            # A named snapshot's entries: stale once the name points elsewhere or is gone.
            named = await asyncio.to_thread(
                self._named_snapshot, shape.template[len(SNAPSHOT_PREFIX) :]
            )
            return None if named is None or not named.memory else named.id
        try:
            snap = await asyncio.to_thread(
                snaps.find_template_snapshot,
                self.settings,
                self.image,
                shape.template,
                shape.cpu,
                shape.memory_mb,
            )
        except TemplateNotFound:
            return None
        return None if snap is None else snap.id

    async def _warm_make(self, snapshot_id: str) -> Prepared:
        """A warm pool entry: a new sandbox id with its workdir (outside the sandboxes dir
        until a create takes it), slot and waiting QEMU, each on the entry's stack (kept in
        `_warm_stacks` until the entry is dropped or a create takes it)."""
        if self._warm_root is None:
            raise SandboxError("node is not started")
        sandbox_id = new_sandbox_id()
        workdir = self._warm_root / sandbox_id
        stack = Cleanup(sandbox_id)
        await asyncio.to_thread(workdir.mkdir, 0o700, False, False)
        node_cleanup.push_workdir(stack, workdir)
        try:
            slot = await self.pool.acquire()
            node_cleanup.push_slot(stack, self.pool, slot)
            prep = await prepare(
                self.repo, self.layers, self.image, snapshot_id,
                name=sandbox_id, workdir=workdir, slot=slot,
            )  # fmt: skip
        except BaseException:
            await self._unwind(stack, "a failed warm entry")
            raise
        # Its QEMU, upper and references (`prepare`'s own stack).
        stack.push(WARM_ENTRY, lambda: discard(prep, self.repo, self.layers))
        self._warm_stacks[sandbox_id] = stack
        return prep

    async def _warm_drop(self, prep: Prepared) -> None:
        stack = self._warm_stacks.pop(prep.name, None)
        if stack is not None:
            await stack.run()

    def _handle(self, machine: Machine, template: str, top: str) -> SandboxHandle:
        return SandboxHandle(
            id=machine.name,
            template=template,
            cpu=machine.vcpus,
            memory_mb=machine.memory_mb,
            disk_size_mb=-(-info(machine.upper).virtual_size // (1024 * 1024)),
            slot=machine.slot,
            workdir=machine.workdir,
            upper=machine.upper,
            top_layer=top,
            vm=machine.vm,
            machine=machine,
        )

    def _machine(self, sandbox_id: str) -> tuple[SandboxHandle, Machine]:
        sb = self.get(sandbox_id)
        if sb.paused:
            raise SandboxPaused(f"sandbox {sandbox_id} is paused")
        if sb.machine is None:
            raise NotPausable(f"sandbox {sandbox_id} was started without snapshot support")
        return sb, sb.machine


def _after_delete_step(name: str) -> None:
    if name == node_cleanup.VM:
        crash_point("delete:vm-gone")
