"""What a node pushes onto a sandbox's cleanup stack (`agentenv.cleanup.Cleanup`), one function
per resource, and the stack rebuilt for a sandbox known only from its files.

The stack is made with the first thing a create acquires and lives on the sandbox's
`SandboxHandle` (`handle.cleanup`) until delete runs it; a failed create, resume or fork runs
the part it built. In acquisition order (so it runs the other way):

- `workdir`: the sandbox's directory (its upper, memory file, records), removed last;
- `references`: every layer and snapshot reference held under the sandbox's id (the node's
  own and those a restore takes), dropped together; then the snapshot a fork made goes with
  its last holder, and layers nothing holds any more (top down);
- `slot`: its network slot (a pause gives it back early: `stack.release(SLOT)`);
- `warm link`: the old name of a warm pool entry's workdir, once its QEMU is gone;
- `vm`: its QEMU (jail, cgroup, VM record, sockets), whichever QEMU runs it now.

A sandbox known only from its workdir (paused, or found by crash recovery) gets the first two
from `on_disk`; an adopted one then gets its slot and QEMU pushed like a created one. A VM
record that crash recovery does not adopt (its QEMU gone, or one of a paused sandbox, a warm
entry, a converter, a template build) gets its slot and QEMU from `push_record`: the stack its
server had built, rebuilt from what it persisted, so recovery frees nothing by hand."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
from collections.abc import Awaitable, Callable
from pathlib import Path

from agentenv.cleanup import Cleanup
from agentenv.config import NetworkPlan
from agentenv.network import Slot, SlotPool, slot_for
from agentenv.network.slot import NETNS_PREFIX
from agentenv.node.sandbox import wait_readable
from agentenv.snapshot import SnapshotStore
from agentenv.snapshot.restore import unlink_relocated
from agentenv.storage import LayerInUse, LayerNotFound, LayerStore, StorageError
from agentenv.vmm import registry as vm_registry
from agentenv.vmm.cgroup import Cgroup
from agentenv.vmm.qemu import QemuVM, remove_socket

log = logging.getLogger(__name__)

WORKDIR = "workdir"
REFS = "references"
SLOT = "slot"
WARM_LINK = "warm link"
VM = "vm"
# A snapshot reference a reset in place takes on a target nothing else may keep (a fork's
# capture held only by the sandbox being reset): a crash between the old guest's end and
# the new one's start runs the sandbox's stack, and the control plane's restart needs the
# target still there. The ":" keeps it out of the orphan sweep by holder name.
RESET_HOLDER = "reset:"


def push_workdir(stack: Cleanup, workdir: Path) -> None:
    stack.push(WORKDIR, lambda: asyncio.to_thread(shutil.rmtree, workdir, True))


def push_refs(stack: Cleanup, holder: str, layers: LayerStore, repo: SnapshotStore) -> None:
    """Before anything is referenced under `holder`: one step drops whatever it took."""
    stack.push(REFS, lambda: asyncio.to_thread(drop_refs, holder, layers, repo))


def push_slot(stack: Cleanup, pool: SlotPool, slot: Slot) -> None:
    stack.push(SLOT, lambda: pool.release(slot))


def push_warm_link(stack: Cleanup, old_workdir: Path) -> None:
    stack.push(WARM_LINK, lambda: asyncio.to_thread(unlink_relocated, old_workdir))


def push_vm(stack: Cleanup, current: Callable[[], QemuVM]) -> None:
    """`current` names the QEMU when the step runs: a capture moves a sandbox to another."""

    async def kill() -> None:
        await current().kill()

    stack.push(VM, kill)


def record_slot(plan: NetworkPlan, rec: vm_registry.VMRecord) -> Slot | None:
    """The network slot a VM record names (its QEMU's namespace), None for a slotless VM."""
    netns = rec.spec.get("netns")
    if not isinstance(netns, str) or not netns.startswith(NETNS_PREFIX):
        return None
    index = netns[len(NETNS_PREFIX) :]
    if not index.isdigit() or int(index) >= plan.max_slots:
        return None
    return slot_for(plan, int(index))


def push_record(
    stack: Cleanup,
    rec: vm_registry.VMRecord,
    pid: int | None,
    vms_dir: Path,
    slot: Slot | None,
    drop_slot: Callable[[Slot], Awaitable[None]],
) -> None:
    """What a VM record of an earlier server persists, pushed in acquisition order: its
    slot (`drop_slot`: no pool runs yet, so recovery tears it down), then its QEMU (`pid`
    if it still runs), cgroup, QMP socket and the record itself."""
    if slot is not None:
        stack.push(SLOT, lambda: drop_slot(slot))
    stack.push(VM, lambda: reap(rec, pid, vms_dir))


async def reap(rec: vm_registry.VMRecord, pid: int | None, vms_dir: Path) -> None:
    """End a QEMU an earlier server started and remove what its record names (the jail
    went with the process)."""
    if pid is not None:
        log.info("ending %s (pid %d) left by a previous server", rec.name, pid)
        with contextlib.suppress(ProcessLookupError):
            fd = os.pidfd_open(pid)
            try:
                os.kill(pid, signal.SIGKILL)
                await wait_readable(fd, 10.0)
            finally:
                os.close(fd)
    if rec.spec.get("cgroup"):
        with contextlib.suppress(Exception):
            await asyncio.to_thread(Cgroup(rec.name).remove)
    await asyncio.to_thread(remove_socket, Path(rec.qmp_socket))
    await asyncio.to_thread(vm_registry.remove, vms_dir, rec.name)


def on_disk(sandbox_id: str, workdir: Path, layers: LayerStore, repo: SnapshotStore) -> Cleanup:
    """The stack of a sandbox that runs nowhere: what its files and references record."""
    stack = Cleanup(sandbox_id)
    push_workdir(stack, workdir)
    push_refs(stack, sandbox_id, layers, repo)
    return stack


def drop_refs(holder: str, layers: LayerStore, repo: SnapshotStore) -> None:
    # Layers only the holder kept, found in the pass that drops its references: one that
    # something else still references (a template's, a live snapshot's) would be refused by
    # `remove` anyway, and skipping it saves reading the qcow2 headers of its chain (#23).
    freed = layers.release(holder)
    # The snapshot a fork made goes with its last child (removed after: its layers are
    # referenced by the snapshot itself until then).
    repo.release(holder)
    remove_unheld_layers(layers, freed)


def remove_unheld_layers(layers: LayerStore, digests: list[str]) -> None:
    """Layers the sandbox was the last to hold (a fork's top layer once the fork snapshot is
    gone), top down, up to the first one something else still uses. Not a store-wide gc:
    that would race with a capture between adding a layer and committing the snapshot that
    references it."""
    for top in digests:
        try:
            chain = layers.chain(top)
        except (LayerNotFound, StorageError):
            continue
        for digest in chain:
            try:
                layers.remove(digest)
            except (LayerInUse, LayerNotFound):
                break


def drop_reset_hold(repo: SnapshotStore, sandbox_id: str) -> None:
    """Let a reset's target go (`RESET_HOLDER`), and remove it if nothing else keeps it."""
    repo.unref_holder(RESET_HOLDER + sandbox_id)
    repo.gc()
