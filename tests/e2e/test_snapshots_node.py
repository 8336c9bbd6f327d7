"""Node with snapshots: create = restore of the template snapshot, pause/resume (also across a
node restart), persistent snapshots, fork, and deletion of all of it."""

from __future__ import annotations

import asyncio
import importlib
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from agentenv.config import Settings
from agentenv.guest.envd.client import EnvdClient
from agentenv.node import host_create as node_module
from agentenv.node.errors import BootFailed, SandboxPaused, UnknownSandbox
from agentenv.node.host import Node, SandboxHandle
from agentenv.snapshot.errors import RestoreFailed

pytestmark = pytest.mark.vm

MEM = 512


async def sh(sb: SandboxHandle, cmd: str) -> str:
    async with EnvdClient(sb.envd_url) as envd:
        code, out, err = await envd.run(cmd, user="root", timeout=60)
    assert code == 0, f"{cmd!r}: {err}"
    return out.strip()


async def test_node_create_pause_restart_resume_snapshot_fork(
    settings: Settings, base_template: Any
) -> None:
    node = Node(settings)
    await node.start()
    try:
        sb = await node.create("base", memory_mb=MEM)
        print(f"create (restore): {sb.boot_s:.3f}s, origin {sb.origin}")
        assert sb.origin == "restore"
        assert await sh(sb, "hostname") == sb.id
        await sh(sb, "echo one > /root/f")
        await node.pause(sb.id)
        assert node.is_alive(sb.id) and sb.paused
        with pytest.raises(SandboxPaused):
            await node.snapshot(sb.id)
    finally:
        await node.close()
    # A new node (a server restart) finds the paused sandbox on disk and resumes it.
    node = Node(settings)
    await node.start()
    try:
        assert node.is_alive(sb.id)
        sb = await node.resume(sb.id)
        print(f"resume after restart: {sb.boot_s:.3f}s")
        assert await sh(sb, "cat /root/f") == "one"
        snap = await node.snapshot(sb.id, "node-test-snap")
        assert snap.names == ["node-test-snap"]
        await sh(sb, "echo two > /root/f")
        child = await node.create("node-test-snap")
        assert child.origin == "restore" and await sh(child, "cat /root/f") == "one"
        assert await sh(child, "hostname") == child.id
        kids = await node.fork(sb.id, 2)
        assert {await sh(k, "cat /root/f") for k in kids} == {"two"}
        assert {await sh(k, "hostname") for k in kids} == {k.id for k in kids}
        for h in [child, *kids, sb]:
            await node.delete(h.id)
        with pytest.raises(UnknownSandbox):
            await node.resume(sb.id)
        node.repo.delete("node-test-snap")
    finally:
        await node.close()


async def test_larger_disk_is_a_restore_grown_online(
    settings: Settings, base_template: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    node = Node(settings)
    await node.start()
    try:
        template_mb = node._validate("base", 1, MEM, None)[3]
        want_mb = template_mb + 1024
        sb = await node.create("base", memory_mb=MEM, disk_size_mb=want_mb)
        print(f"create with a {want_mb} MB disk: {sb.boot_s:.3f}s, origin {sb.origin}")
        assert sb.origin in ("restore", "warm") and sb.disk_size_mb == want_mb
        # The guest sees the new size at once: the kernel's disk and the mounted ext4.
        sectors = int(await sh(sb, "cat /sys/class/block/vda/size"))
        assert sectors * 512 == want_mb * 1024 * 1024
        size_mb = int(await sh(sb, "df -BM --output=size / | tail -1 | tr -dc 0-9"))
        assert template_mb < want_mb * 9 // 10 < size_mb <= want_mb
        # More than the template's whole disk fits now, and data past it reads back.
        await sh(sb, f"fallocate -l {template_mb + 100}M /root/big && sync")
        await sh(sb, "head -c 4M /dev/urandom > /root/tail && sync")
        assert int(await sh(sb, "stat -c %s /root/tail")) == 4 * 1024 * 1024
        await node.delete(sb.id)

        # A resize that fails gives a clear error and leaves no sandbox behind.
        monkeypatch.setattr(
            node_module, "GROW_FS", "echo no resize2fs here >&2; exit 3 # {sectors}"
        )
        before = set(settings.sandboxes_dir.iterdir())
        with pytest.raises(
            BootFailed, match=r"growing its filesystem to \d+ MB failed: no resize2fs"
        ):
            await node.create("base", memory_mb=MEM, disk_size_mb=want_mb)
        assert set(settings.sandboxes_dir.iterdir()) == before and node.list() == []
    finally:
        await node.close()


async def test_fork_eight_in_parallel_and_all_or_none(
    settings: Settings, base_template: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Eight children restored concurrently: all run, each has its own disk. Then a fork
    whose third child fails, and one cancelled midway: the others are cancelled or released,
    nothing is left."""
    # No warm pool: its background refills would change the holders compared below.
    node = Node(replace(settings, warm_low=0, warm_high=0))
    await node.start()
    try:
        src = await node.create("base", memory_mb=MEM)
        await sh(src, "echo parent > /root/p")
        t0 = time.monotonic()
        kids = await node.fork(src.id, 8)
        wall = time.monotonic() - t0
        print(f"fork of 8 (max_starts {settings.max_starts}): {wall:.2f}s, {wall / 8:.3f}s/child")
        assert len({k.id for k in kids}) == 8 and src.id not in {k.id for k in kids}
        assert [await sh(k, "hostname") for k in kids] == [k.id for k in kids]
        assert {await sh(k, "cat /root/p") for k in kids} == {"parent"}
        await sh(kids[0], "echo mine > /root/only-0 && sync")
        for k in kids[1:]:
            assert await sh(k, "test -e /root/only-0 && echo yes || echo no") == "no"
        assert await sh(src, "test -e /root/only-0 && echo yes || echo no") == "no"
        assert await sh(kids[0], "cat /root/only-0") == "mine"
        for k in kids:
            await node.delete(k.id)

        fork_module = importlib.import_module("agentenv.snapshot.fork")
        real_identify = fork_module.identify
        calls = 0

        async def flaky(*args: Any, **kwargs: Any) -> None:
            nonlocal calls
            calls += 1
            if calls == 3:
                raise RestoreFailed("injected failure of the third child")
            await real_identify(*args, **kwargs)

        monkeypatch.setattr(fork_module, "identify", flaky)
        before = set(settings.sandboxes_dir.iterdir())
        held = holders(node)
        with pytest.raises(RestoreFailed, match="injected"):
            await node.fork(src.id, 8)
        assert calls >= 3
        assert [h.id for h in node.list()] == [src.id]
        assert set(settings.sandboxes_dir.iterdir()) == before
        assert node.pool.busy == [src.slot]
        ours = [c for c in qemu_cmdlines() if str(settings.sandboxes_dir) in c]
        assert len(ours) == 1 and src.id in ours[0], ours
        # The capture is held by nobody now (no child, no claim): the GC takes it and its
        # layer references, and every holder is one from before.
        await asyncio.to_thread(node.repo.gc)
        assert holders(node) == held

        # Cancelled while two children are made and others wait or restore: the same.
        second = asyncio.Event()
        calls = 0

        async def stuck(*args: Any, **kwargs: Any) -> None:
            nonlocal calls
            calls += 1
            await real_identify(*args, **kwargs)
            if calls == 2:
                second.set()
            await asyncio.sleep(3600)

        monkeypatch.setattr(fork_module, "identify", stuck)
        task = asyncio.create_task(node.fork(src.id, 8))
        await asyncio.wait_for(second.wait(), 300)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert [h.id for h in node.list()] == [src.id]
        assert set(settings.sandboxes_dir.iterdir()) == before
        assert node.pool.busy == [src.slot]
        ours = [c for c in qemu_cmdlines() if str(settings.sandboxes_dir) in c]
        assert len(ours) == 1 and src.id in ours[0], ours
        await asyncio.to_thread(node.repo.gc)
        assert holders(node) == held
        await node.delete(src.id)
    finally:
        await node.close()


def qemu_cmdlines() -> list[str]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            # QEMU itself, not the launcher in front of a confined one (it carries QEMU's argv).
            if "qemu-system" in cmd.split(" ", 1)[0]:
                found.append(cmd)
    return found


def holders(node: Node) -> set[str]:
    """Everyone holding a layer or a snapshot."""
    snaps = {h for s in node.repo.list() for h in s.holders}
    return node.layers.all_holders() | snaps
