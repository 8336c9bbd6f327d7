"""`snapshot.restore.prepare` under cancellation, on the real repository and layer store: a
cancel that lands while a reference is being taken in a thread (the thread goes on and takes
it) leaves nothing held. Found as a fork child's references leaked under load
(tests/e2e/test_snapshots_node); the mock only holds the thread back so the cancel lands in
that window every time."""

from __future__ import annotations

import asyncio
import shutil
import threading
from dataclasses import replace
from typing import Any

import pytest

from agentenv.config import Settings
from agentenv.network import create_slot, destroy_slot
from agentenv.node.host import Node
from agentenv.snapshot.restore import prepare
from agentenv.snapshot.templates import ensure_template_snapshot

pytestmark = pytest.mark.vm


async def test_a_cancel_while_references_are_taken_leaves_nothing_held(
    settings: Settings, base_template: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with Node(replace(settings, warm_low=0, warm_high=0)) as node:
        snap = await ensure_template_snapshot(settings, image=node.image)
        slot = await create_slot(settings.network, owner=settings.slots_dir)
        try:
            for store in (node.repo, node.layers):
                entered, go, done = threading.Event(), threading.Event(), threading.Event()
                real = store.ref

                def held_back(*args: Any, real: Any = real, ev: Any = (entered, go, done)) -> None:
                    ev[0].set()
                    ev[1].wait(30)
                    real(*args)
                    ev[2].set()

                monkeypatch.setattr(store, "ref", held_back)
                name = f"cancelled-{type(store).__name__}"
                task = asyncio.create_task(
                    prepare(
                        node.repo,
                        node.layers,
                        node.image,
                        snap.id,
                        name=name,
                        workdir=settings.sandboxes_dir / name,
                        slot=slot,
                    )
                )
                assert await asyncio.to_thread(entered.wait, 30)
                task.cancel()
                # Twice, as a task group aborting again would: the undo still runs whole.
                await asyncio.sleep(0.05)
                task.cancel()
                await asyncio.sleep(0.05)
                go.set()
                with pytest.raises(asyncio.CancelledError):
                    await task
                monkeypatch.undo()
                # Look once the held-back thread has taken its reference.
                assert await asyncio.to_thread(done.wait, 30)
                assert name not in node.repo.get(snap.id).holders
                assert not node.layers.held_by(name)
                assert not (settings.sandboxes_dir / name / "rootfs.qcow2").exists()
                # The workdir is the caller's (as the node's create removes it).
                shutil.rmtree(settings.sandboxes_dir / name)
        finally:
            await destroy_slot(slot)
