"""A create's first acquisitions, and a warm entry becoming the sandbox that takes it.

Split from `host_create`: the steps both create paths (a template's, a named snapshot's)
share, in the order a sandbox's cleanup stack needs them."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Callable
from pathlib import Path

from agentenv.cleanup import Cleanup
from agentenv.faults import crash_point
from agentenv.network import Slot
from agentenv.node.cleanup import push_refs, push_slot, push_vm, push_warm_link, push_workdir
from agentenv.node.host_base import NodeBase
from agentenv.node.sandbox import SandboxHandle
from agentenv.snapshot.restore import Prepared, relocate
from agentenv.snapshot.restore import rename as rename_prepared
from agentenv.vmm.qemu import QemuVM


class NodeWarm(NodeBase):
    """The acquisitions `host_create.NodeCreate` starts each create with."""

    async def _acquire(
        self,
        sandbox_id: str,
        workdir: Path,
        stack: Cleanup,
        warm: Prepared | None,
        handle_now: Callable[[], SandboxHandle | None],
    ) -> Slot:
        """A create's first acquisitions, each onto the sandbox's `stack`: its workdir, the
        step that drops its references, and its slot: a new one from the pool, or `warm`'s
        (the warm entry becomes the sandbox: `_adopt_warm`). `handle_now()` is the sandbox's
        handle once there is one (its QEMU is the one to kill from then on)."""
        if warm is None:
            await asyncio.to_thread(workdir.mkdir, 0o700, False, False)
        push_workdir(stack, workdir)
        push_refs(stack, sandbox_id, self.layers, self.repo)
        if warm is None:
            slot = await self.pool.acquire()
            push_slot(stack, self.pool, slot)
            return slot

        def vm_now() -> QemuVM:
            handle = handle_now()
            return warm.vm if handle is None else handle.vm

        await self._adopt_warm(warm, sandbox_id, workdir, stack, vm_now)
        return warm.slot

    async def _adopt_warm(
        self,
        prep: Prepared,
        sandbox_id: str,
        workdir: Path,
        stack: Cleanup,
        vm_now: Callable[[], QemuVM],
    ) -> None:
        """A warm entry taken by a create becomes the sandbox `sandbox_id`: its slot and
        QEMU go onto the sandbox's `stack` (`vm_now` names the QEMU when the step runs), it
        takes the id and moves to `workdir` (which must not exist)."""
        warm_workdir, warm_name = prep.workdir, prep.name
        push_slot(stack, self.pool, prep.slot)
        # Until it is renamed and moved: the entry's references and files.
        stack.push("warm entry", lambda: self._drop_entry(warm_name, warm_workdir))
        push_warm_link(stack, warm_workdir)
        push_vm(stack, vm_now)
        if prep.name != sandbox_id:
            # The entry was made before anyone knew the id; it takes the caller's.
            await rename_prepared(prep, sandbox_id, self.repo, self.layers)
        # From here on it is an ordinary sandbox, in the sandboxes dir.
        await relocate(prep, workdir)
        stack.drop("warm entry")
        crash_point("create:relocated")

    async def _drop_entry(self, name: str, workdir: Path) -> None:
        """What a warm entry taken by a create still holds under its own name and path
        (nothing once it is renamed and moved: the references then are the sandbox's, and
        the old path a symlink that `WARM_LINK` removes)."""
        await asyncio.to_thread(self.layers.unref_holder, name)
        await asyncio.to_thread(self.repo.unref_holder, name)
        if not await asyncio.to_thread(workdir.is_symlink):
            await asyncio.to_thread(shutil.rmtree, workdir, True)
