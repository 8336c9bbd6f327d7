"""Warm pools: a create of a recently used shape takes a QEMU spawned before it was asked
for (and moves it into the sandboxes dir, where pause and snapshot work as for any other), the
pool refills, stale, idle and orphaned entries are discarded, and close leaves nothing."""

from __future__ import annotations

import asyncio
import contextlib
import os
import statistics
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from agentenv.config import Settings
from agentenv.contract.ids import new_sandbox_id
from agentenv.guest.envd.client import EnvdClient, EnvdError
from agentenv.node.errors import InvalidResources
from agentenv.node.host import GuestInit, Node, SandboxHandle
from agentenv.node.host_create import BatchChild
from agentenv.node.warm import Shape, snapshot_shape
from agentenv.template.catalog import TemplateCatalog
from agentenv.vmm import registry as vm_registry

pytestmark = pytest.mark.vm

MEM = 512
SHAPE = Shape("base", 1, MEM)
FILL_TIMEOUT_S = 60.0


async def sh(sb: SandboxHandle, cmd: str) -> str:
    async with EnvdClient(sb.envd_url) as envd:
        code, out, err = await envd.run(cmd, user="root", timeout=60)
    assert code == 0, f"{cmd!r}: {err}"
    return out.strip()


async def wait_ready(node: Node, count: int, shape: Shape = SHAPE) -> None:
    deadline = time.monotonic() + FILL_TIMEOUT_S
    while len(node.warm.ready(shape)) < count:
        assert time.monotonic() < deadline, f"warm pool did not reach {count} entries"
        await asyncio.sleep(0.1)


def warm_entries(settings: Settings) -> list[Path]:
    root = settings.warm_dir
    return [e for d in root.iterdir() for e in d.iterdir()] if root.is_dir() else []


async def wait_gone(pid: int, workdir: Path) -> None:
    deadline = time.monotonic() + 10
    while await asyncio.to_thread(lambda: os.path.exists(f"/proc/{pid}") or workdir.exists()):
        assert time.monotonic() < deadline, f"discarded entry left QEMU {pid} or {workdir}"
        await asyncio.sleep(0.05)


async def test_create_takes_prespawned_qemu_and_pool_refills(
    settings: Settings, base_template: Any
) -> None:
    node = Node(replace(settings, warm_low=1, warm_high=1))
    await node.start()
    try:
        # The shape joins the pool with its first create, which cannot be warm yet.
        first = await node.create("base", memory_mb=MEM)
        assert first.origin == "restore"
        await node.delete(first.id)
        await wait_ready(node, 1)
        (entry,) = node.warm.ready(SHAPE)
        # Waiting entries are not sandboxes: they live outside the sandboxes dir.
        assert entry.workdir.parent.parent == settings.warm_dir
        assert not (settings.sandboxes_dir / entry.name).exists()
        spawned_pid = entry.vm.pid
        assert spawned_pid is not None and entry.vm.started_at is not None
        asked_at = time.monotonic()
        assert entry.vm.started_at < asked_at

        sb = await node.create("base", memory_mb=MEM)
        assert sb.origin == "warm" and node.warm.taken == 1
        assert sb.id == entry.name and sb.pid == spawned_pid
        assert await sh(sb, "hostname") == sb.id
        assert await sh(sb, "echo warm > /root/f; cat /root/f") == "warm"
        # Taken, it moved into the sandboxes dir while QEMU ran; what QEMU opens later (a
        # sealed disk's new upper, a RAM stream) goes there too.
        assert sb.workdir == settings.sandboxes_dir / sb.id and sb.upper.parent == sb.workdir
        assert not entry.workdir.exists() or entry.workdir == sb.workdir
        snap = await node.snapshot(sb.id, "warm-test-snap")
        assert sb.upper.parent == sb.workdir
        await node.pause(sb.id)
        sb = await node.resume(sb.id)
        assert await sh(sb, "cat /root/f") == "warm"
        node.repo.delete(snap.id)

        # Refilled with a new guest; a rebuilt snapshot makes it stale and it is discarded.
        await wait_ready(node, 1)
        (refill,) = node.warm.ready(SHAPE)
        assert refill.vm.pid not in (None, spawned_pid) and refill.name != sb.id
        stale_pid = refill.vm.pid
        assert stale_pid is not None
        assert node.warm.take(SHAPE, "0" * 64) is None
        assert node.warm.discarded == 1
        await wait_gone(stale_pid, refill.workdir)
        await node.delete(sb.id)
    finally:
        await node.close()
    assert not list(settings.sandboxes_dir.glob("*/rootfs.qcow2"))
    assert not warm_entries(settings) and not list(settings.warm_dir.iterdir())


async def test_a_warm_guest_takes_the_id_and_init_the_caller_gives(
    settings: Settings, base_template: Any
) -> None:
    """The control plane chooses a sandbox's id before a node runs it; a warm entry was
    spawned under a name of its own, so taking it renames it (references, cgroup, VM record)
    and its envd gets the caller's token and env vars in the one `/init`."""
    node = Node(replace(settings, warm_low=1, warm_high=1))
    await node.start()
    try:
        await node.delete((await node.create("base", memory_mb=MEM)).id)
        await wait_ready(node, 1)
        (entry,) = node.warm.ready(SHAPE)
        old_name, pid, old_workdir = entry.name, entry.vm.pid, entry.workdir
        chosen = new_sandbox_id()
        token = "tok-" + chosen
        sb = await node.create(
            "base",
            memory_mb=MEM,
            sandbox_id=chosen,
            init=GuestInit({"FROM_CALLER": "yes"}, token),
        )
        assert sb.origin == "warm" and sb.id == chosen and sb.pid == pid
        assert sb.workdir == settings.sandboxes_dir / chosen
        # Its VM record and cgroup follow the new name; nothing is left under the old one.
        names = {r.name: r for r in vm_registry.load_all(settings.vms_dir)}
        assert chosen in names and old_name not in names
        assert names[chosen].pid == pid and names[chosen].workdir == str(sb.workdir)
        procs = (sb.vm.cgroup.dirs[0] / "cgroup.procs").read_text().split()  # type: ignore[union-attr]
        assert sb.vm.cgroup.name == chosen and procs  # type: ignore[union-attr]
        assert not any((d.parent / old_name).exists() for d in sb.vm.cgroup.dirs)  # type: ignore[union-attr]
        assert node.layers.held_by(chosen) and not node.layers.held_by(old_name)
        # One `/init`: hostname, the caller's env var, and its token required from now on.
        async with EnvdClient(sb.envd_url, token) as envd:
            code, out, _ = await envd.run("hostname; echo $FROM_CALLER", user="root", timeout=60)
        assert code == 0 and out.split() == [chosen, "yes"]
        async with EnvdClient(sb.envd_url) as anonymous:
            with pytest.raises(EnvdError):
                await anonymous.run("true", user="root", timeout=30)
        # An id in use is refused before anything is made.
        with pytest.raises(InvalidResources, match="already in use"):
            await node.create("base", memory_mb=MEM, sandbox_id=chosen)
        await node.delete(chosen)
        assert not (settings.sandboxes_dir / chosen).exists()
        # The entry's old workdir (a symlink while its QEMU ran) goes with it.
        assert not old_workdir.is_symlink() and not old_workdir.exists(), old_workdir
    finally:
        await node.close()
    assert not vm_registry.load_all(settings.vms_dir)


async def test_entries_of_a_deleted_template_and_of_idle_shapes_are_dropped(
    settings: Settings, base_template: Any
) -> None:
    catalog = TemplateCatalog(settings)
    base = catalog.get("base")
    copy = replace(base, name="warm-copy")
    catalog.put(copy)
    shape = Shape("warm-copy", 1, MEM)
    # The product's default watermarks (the suite turns pools off in its environment); a
    # short check period so the test need not wait.
    node = Node(replace(settings, warm_low=Settings.warm_low, warm_high=Settings.warm_high))
    assert (node.warm.low, node.warm.high) == (1, 2)
    node.warm.check_s = 0.2
    await node.start()
    try:
        await node.delete((await node.create("warm-copy", memory_mb=MEM)).id)
        await node.delete((await node.create("base", memory_mb=MEM)).id)
        await wait_ready(node, 2, shape)
        await wait_ready(node, 2)
        # Never more than `high`, however long it runs.
        await asyncio.sleep(1)
        assert len(node.warm.ready(shape)) == 2 and len(node.warm.ready(SHAPE)) == 2
        doomed = [(p.vm.pid, p.workdir) for p in node.warm.ready(shape)]
        catalog.delete("warm-copy")
        for pid, workdir in doomed:
            assert pid is not None
            await wait_gone(pid, workdir)
        assert shape not in node.warm.shapes() and node.warm.discarded == 2
        # The base shape is untouched until it idles.
        assert len(node.warm.ready(SHAPE)) == 2
        idle = [(p.vm.pid, p.workdir) for p in node.warm.ready(SHAPE)]
        node.warm.idle_s = 0.5
        for pid, workdir in idle:
            assert pid is not None
            await wait_gone(pid, workdir)
        assert node.warm.shapes() == [] and warm_entries(settings) == []
    finally:
        await node.close()
        for name in ("warm-copy",):
            with contextlib.suppress(Exception):
                catalog.delete(name)
        with contextlib.suppress(Exception):
            node.repo.delete("warm-copy.1c.512m")


async def test_create_p50_with_and_without_warm_pool(
    settings: Settings, base_template: Any
) -> None:
    times: dict[str, list[float]] = {}
    for label, high in (("cold restore", 0), ("warm", 1)):
        node = Node(replace(settings, warm_low=high, warm_high=high))
        await node.start()
        try:
            await node.delete((await node.create("base", memory_mb=MEM)).id)
            times[label] = []
            for _ in range(3):
                if high:
                    await wait_ready(node, 1)
                asked_at = time.monotonic()
                sb = await node.create("base", memory_mb=MEM)
                assert sb.origin == ("warm" if high else "restore")
                # The promise of the pool: no process spawn on the create's critical path.
                spawned_at = sb.vm.started_at
                assert spawned_at is not None and (spawned_at < asked_at) == bool(high)
                times[label].append(sb.boot_s)
                await node.delete(sb.id)
        finally:
            await node.close()
    p50 = {k: statistics.median(v) for k, v in times.items()}
    # Printed, not asserted: on a shared 2-core TCG host the gap is a fraction of a second
    # and other load swamps it.
    print(f"create p50: cold restore {p50['cold restore']:.3f}s, warm {p50['warm']:.3f}s")


async def test_creates_from_a_named_snapshot_take_warm_entries_from_the_third_on(
    settings: Settings, base_template: Any
) -> None:
    """An RL task state: its second create puts the snapshot's shape in the pool, the next
    ones take a waiting QEMU with the state's files; a deleted snapshot's entries go."""
    node = Node(replace(settings, warm_low=1, warm_high=1))
    node.warm.check_s = 0.2
    await node.start()
    shape = snapshot_shape("warm-task", 1, MEM)
    try:
        src = await node.create("base", memory_mb=MEM)
        await sh(src, "echo task-state > /root/state")
        await node.snapshot(src.id, "warm-task")
        await node.delete(src.id)
        first = await node.create("warm-task")
        assert first.origin == "restore" and shape not in node.warm.shapes()
        second = await node.create("warm-task")
        await wait_ready(node, 1, shape)
        third = await node.create("warm-task")
        assert third.origin == "warm" and second.origin == "restore"
        assert await sh(third, "cat /root/state") == "task-state"
        # A fork of the snapshot: a child takes the entry that waits, the other restores.
        await wait_ready(node, 1, shape)
        children = [BatchChild(new_sandbox_id()) for _ in range(2)]
        forked = await node.create_batch("warm-task", children)
        assert forked is not None
        kids = [h for h in forked if isinstance(h, SandboxHandle)]
        assert sorted(h.origin for h in kids) == ["restore", "warm"], forked
        assert [await sh(h, "cat /root/state") for h in kids] == ["task-state"] * 2
        for sb in (first, second, third, *kids):
            await node.delete(sb.id)
        await wait_ready(node, 1, shape)
        doomed = [(p.vm.pid, p.workdir) for p in node.warm.ready(shape)]
        await asyncio.to_thread(node.repo.delete, "warm-task")
        for pid, workdir in doomed:
            assert pid is not None
            await wait_gone(pid, workdir)
        assert shape not in node.warm.shapes()
    finally:
        await node.close()
    assert warm_entries(settings) == []
