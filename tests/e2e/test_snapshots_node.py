"""Node with snapshots: create = restore of the template snapshot, pause/resume (also across a
node restart), persistent snapshots, fork, and deletion of all of it."""

from __future__ import annotations

from typing import Any

import pytest

from agentenv.config import Settings
from agentenv.guest.envd.client import EnvdClient
from agentenv.orchestrator import node as node_module
from agentenv.orchestrator.node import Node, SandboxHandle
from agentenv.orchestrator.node_errors import BootFailed, SandboxPaused, UnknownSandbox

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
