"""Reset in place (#24): a running sandbox goes back to a saved state under the same id, in the
same network slot (netns, tap, egress rules untouched: same sandbox, same policy), on the same
cleanup stack. Only its QEMU and its upper are new.

Why not a delete and a create: those give the slot back and take another (netlink and nft
work both ways), remove and remake the workdir and its records, and drop and retake every
reference: ~80 ms of the host's work per reset that a reset of the same sandbox does not need.
A state cannot be loaded into the QEMU that runs (QMP `migrate-incoming` needs a QEMU started
with `-incoming`), so the old one is killed first: the new one runs under the same name, which
keys its VM record and cgroup.

A crash in between leaves the workdir with no QEMU: crash recovery finds the sandbox lost and
runs its stack (files, references; the slot goes with the dead server's pool), and the control
plane, whose row says `resuming` with the target, starts it again from the target
(`control.sandbox_reset._finish_reset`); a target nothing else may keep (a fork's capture
whose last child this is) is held under `RESET_HOLDER` meanwhile, and that restart's create
lets it go (so does a delete of the id). A crash after the new QEMU has its state leaves a
sandbox that recovery adopts as any other."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time

from agentenv.aio import thread_whole
from agentenv.faults import crash_point
from agentenv.node.cleanup import (
    RESET_HOLDER,
    VM,
    WARM_LINK,
    drop_reset_hold,
    remove_unheld_layers,
)
from agentenv.node.errors import (
    InvalidResources,
    NotResettable,
    ResetLost,
    SandboxError,
    UnknownSandbox,
)
from agentenv.node.files import SandboxFiles
from agentenv.node.host_pause import NodePause
from agentenv.node.sandbox import NO_INIT, GuestInit, SandboxHandle, TemplateDefaults
from agentenv.snapshot import Snapshot, SnapshotError

log = logging.getLogger(__name__)


class NodeReset(NodePause):
    """`reset` of a `host.Node`."""

    async def reset(
        self, sandbox_id: str, template: str, *, init: GuestInit = NO_INIT
    ) -> SandboxHandle:
        """Put the running sandbox back to `template`'s saved state (a template's snapshot
        or a named memory snapshot of the same machine) in place; its envd gets the full
        `/init` of a create (`init`). `ResetLost` when it failed once the old guest was
        stopped (the sandbox is gone: its stack ran); any other error is raised before
        anything changed (`NotResettable`: it cannot be done in place here)."""
        if self._boot is None or self._accel is None:
            raise SandboxError("node is not started")
        old = self._sandboxes.get(sandbox_id)
        if old is None:
            raise UnknownSandbox(f"sandbox {sandbox_id!r} does not exist")
        if old.paused:
            raise NotResettable(f"sandbox {sandbox_id} is paused")
        snap, top, defaults = await self._reset_target(template, old)
        old_refs = await asyncio.to_thread(self._target_refs, old)
        # A target with no name (a fork's capture) may be kept by this sandbox alone: held
        # through the swap, so a crash in it leaves the target for the restart.
        hold = not snap.names
        if hold:
            await asyncio.to_thread(self.repo.ref, snap.id, RESET_HOLDER + sandbox_id)
        # From here the old guest is going: the sandbox is not listed until its new one runs,
        # and its place on the node is kept for it meanwhile.
        try:
            with self.admission.kept(old.memory_mb):
                del self._sandboxes[sandbox_id]
                self.memory.forget(sandbox_id)
                handle = await self._swap(old, template, snap, top, defaults, init)
        finally:
            if hold:
                await thread_whole(drop_reset_hold, self.repo, sandbox_id)
        stale = old_refs - await asyncio.to_thread(self._target_refs, handle)
        if stale:
            # The reset is done: a reference left behind is a leak to log, not a failure.
            try:
                await asyncio.to_thread(self._drop_stale_refs, sandbox_id, stale)
            except Exception:
                log.exception("sandbox %s: dropping its old references failed", sandbox_id)
        log.info("sandbox %s reset to %s in %.2fs", sandbox_id, template, handle.boot_s)
        return handle

    async def _swap(
        self,
        old: SandboxHandle,
        template: str,
        snap: Snapshot,
        top: str,
        defaults: TemplateDefaults | None,
        init: GuestInit,
    ) -> SandboxHandle:
        """The old QEMU and upper out, the saved state into a new QEMU in the same slot and
        workdir; on failure the sandbox's whole stack runs."""
        sandbox_id = old.id
        t0 = time.monotonic()
        stack = old.cleanup
        files = SandboxFiles(old.workdir)
        try:
            await self.conversions.cancel(sandbox_id)
            await stack.release(VM)
            await stack.release(WARM_LINK)
            crash_point("reset:deleted")
            await asyncio.to_thread(_clear_guest_files, files)
            await thread_whole(self.layers.ref, top, sandbox_id)
            if template != old.template or top != old.top_layer:
                await self._rewrite_meta(files, template, snap, top, old, defaults)
            handle = await self._restore(
                snap, sandbox_id, template, old.workdir, old.slot, top, stack,
                origin="reset", defaults=defaults, init=init,
            )  # fmt: skip
            handle.egress = old.egress
            if handle.disk_size_mb < old.disk_size_mb:
                await self._grow_disk(handle, old.disk_size_mb)
        except BaseException as exc:
            await self._unwind(stack, "the failed reset")
            if isinstance(exc, Exception):
                raise ResetLost(f"sandbox {sandbox_id}: its reset failed: {exc}") from exc
            raise
        handle.boot_s = time.monotonic() - t0
        self._sandboxes[sandbox_id] = handle
        return handle

    async def _reset_target(
        self, template: str, old: SandboxHandle
    ) -> tuple[Snapshot, str, TemplateDefaults | None]:
        """The memory snapshot a reset to `template` restores, the top layer the sandbox
        then holds and the template's defaults (None for a named snapshot, as its create)."""
        named = await asyncio.to_thread(self._named_snapshot, template)
        if named is not None:
            if not named.memory:
                raise NotResettable(f"snapshot {template!r} holds no memory")
            if (named.vcpus, named.memory_mb) != (old.cpu, old.memory_mb):
                raise InvalidResources(
                    f"{template!r} is a {named.vcpus} vCPU / {named.memory_mb} MB machine; "
                    f"sandbox {old.id} is {old.cpu} / {old.memory_mb}: a reset keeps the machine"
                )
            return named, named.top_layer, None
        if not self.snapshots:
            raise NotResettable("this node keeps no snapshots")
        top, _, _, _, defaults = await asyncio.to_thread(
            self._validate, template, old.cpu, old.memory_mb, None
        )
        snap = await self._template_snapshot(template, old.cpu, old.memory_mb)
        if snap is None:
            raise NotResettable(f"template {template!r} has no snapshot to restore")
        return snap, top, defaults

    def _target_refs(self, handle: SandboxHandle) -> set[tuple[str, str]]:
        """What a running sandbox references for the state it started from: its top layer,
        and the snapshot backing its RAM with that snapshot's top layer."""
        refs = {("layer", handle.top_layer)}
        snap_id = handle.machine.snapshot_id if handle.machine is not None else None
        if snap_id is not None:
            refs.add(("snapshot", snap_id))
            # Gone already: nothing of it to drop.
            with contextlib.suppress(SnapshotError):
                refs.add(("layer", self.repo.get(snap_id).top_layer))
        return refs

    def _drop_stale_refs(self, holder: str, stale: set[tuple[str, str]]) -> None:
        """The old target's references the new one does not share, and what only they kept
        (a fork's capture once its last child moved on; its top layer)."""
        layers = []
        for kind, key in stale:
            if kind == "snapshot":
                self.repo.unref(key, holder)
            else:
                self.layers.unref(key, holder)
                layers.append(key)
        self.repo.gc()
        remove_unheld_layers(self.layers, self.layers.unheld(layers))

    async def _rewrite_meta(
        self,
        files: SandboxFiles,
        template: str,
        snap: Snapshot,
        top: str,
        old: SandboxHandle,
        defaults: TemplateDefaults | None,
    ) -> None:
        """`sandbox.json` names the new target before its guest runs (a restart adopts it
        by what the file says); its metadata stays."""
        meta = json.loads(await asyncio.to_thread(files.meta.read_text))
        metadata = meta.get("metadata") if isinstance(meta, dict) else None
        await self._write_meta(
            files.workdir, template, snap.vcpus, snap.memory_mb, old.disk_size_mb, top,
            old.egress, defaults, metadata if isinstance(metadata, dict) else None,
        )  # fmt: skip


def _clear_guest_files(files: SandboxFiles) -> None:
    """The old guest's disk (the create's upper and any a capture moved it on to) and own
    RAM file: the restore makes a new upper where the first was."""
    for path in [*files.workdir.glob("rootfs*.qcow2"), files.memory]:
        path.unlink(missing_ok=True)
