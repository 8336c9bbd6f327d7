"""A paused sandbox's RAM stream turned into a memory file of its own in the background, on
real microVMs: what the resume after it finds, a resume or delete while it runs, and a
conversion that fails."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any

import pytest

from agentenv.config import Settings
from agentenv.guest.envd.client import EnvdClient
from agentenv.node.host import Node, SandboxHandle
from agentenv.snapshot.errors import SnapshotError
from agentenv.snapshot.pause import STREAM, convert_stream, paused_state
from agentenv.vmm import qemu_migration
from agentenv.vmm.qemu_base import QemuBase

pytestmark = pytest.mark.vm

MEM = 256


async def sh(sb: SandboxHandle, cmd: str) -> str:
    async with EnvdClient(sb.envd_url) as envd:
        code, out, err = await envd.run(cmd, user="root", timeout=60)
    assert code == 0, f"{cmd!r}: {err}"
    return out.strip()


async def with_state(node: Node) -> SandboxHandle:
    sb = await node.create("base", memory_mb=MEM)
    await sh(sb, "echo kept > /root/f; sleep 600 > /dev/null 2>&1 & echo $! > /root/pid")
    return sb


async def still_there(sb: SandboxHandle) -> None:
    assert await sh(sb, "cat /root/f") == "kept"
    assert await sh(sb, "kill -0 $(cat /root/pid) && echo alive") == "alive"
    assert await sh(sb, "hostname") == sb.id


def kind_of(workdir: Path) -> str | None:
    """How the sandbox paused in `workdir` holds its RAM ("stream" or "state")."""
    record = paused_state(workdir)
    return None if record is None else record.kind


def leftovers(workdir: Path) -> list[str]:
    return sorted(
        p.name for p in workdir.iterdir() if p.name.endswith(".cv") or p.name == "convert"
    )


def count_asks(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every `query-migrate` any VM is asked from here on."""
    asked: list[str] = []
    execute = QemuBase._execute

    async def counting(self: QemuBase, cmd: str, args: dict[str, object] | None = None) -> object:
        if cmd == "query-migrate":
            asked.append(self.name)
        return await execute(self, cmd, args)

    monkeypatch.setattr(QemuBase, "_execute", counting)
    return asked


async def test_the_resume_after_a_conversion_loads_device_state_only(
    settings: Settings, base_template: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with Node(settings) as node:
        sb = await with_state(node)
        workdir = node.settings.sandboxes_dir / sb.id
        # The stream's save is waited for by QEMU's MIGRATION events, not by asking: a few
        # asks per change of status, one per MIGRATION_ASK_S between (asking every 2 ms was
        # hundreds of QMP round trips per pause).
        asked = count_asks(monkeypatch)
        started = time.monotonic()
        await node.pause(sb.id)
        took = time.monotonic() - started
        assert 0 < len(asked) <= 4 + took / qemu_migration.MIGRATION_ASK_S, (len(asked), took)
        await node.conversions.wait(sb.id)
        assert kind_of(workdir) == "state"
        assert not (workdir / STREAM).exists() and leftovers(workdir) == []
        assert node.conversions.converted == 1 and node.conversions.failed == 0
        sb = await node.resume(sb.id)
        print(f"resume after conversion: {sb.boot_s:.3f}s")
        await still_there(sb)
        # The sandbox now owns its RAM file: the next pause is device state only.
        await node.pause(sb.id)
        assert not node.conversions.busy(sb.id)
        assert kind_of(workdir) == "state"
        sb = await node.resume(sb.id)
        await still_there(sb)


async def test_resume_and_delete_while_converting(settings: Settings, base_template: Any) -> None:
    async with Node(settings) as node:
        a = await with_state(node)
        b = await with_state(node)
        await node.pause(a.id)
        await node.pause(b.id)
        # a converts first (one at a time), b waits in the queue: resuming b drops its
        # conversion and loads the stream; resuming a waits for its conversion.
        a_back, b_back = await asyncio.gather(node.resume(a.id), node.resume(b.id))
        await still_there(a_back)
        await still_there(b_back)
        assert not node.conversions.busy(a.id) and not node.conversions.busy(b.id)

        c = await with_state(node)
        await node.pause(c.id)
        for _ in range(400):
            if c.id in node.conversions._running:
                break
            await asyncio.sleep(0.05)
        workdir = node.settings.sandboxes_dir / c.id
        await node.delete(c.id)
        assert not node.conversions.busy(c.id)
        assert not workdir.exists()


async def test_a_failed_conversion_leaves_the_stream_to_resume_from(
    settings: Settings, base_template: Any
) -> None:
    async with Node(settings) as node:
        sb = await with_state(node)
        workdir = node.settings.sandboxes_dir / sb.id
        await node.pause(sb.id)
        # Take the stream away from the background conversion, then try again by hand.
        await node.conversions.cancel(sb.id)
        os.rename(workdir / STREAM, workdir / "stream.aside")
        with pytest.raises(SnapshotError, match="converting its RAM stream failed"):
            await convert_stream(workdir, node.image)
        assert kind_of(workdir) == "stream"
        assert leftovers(workdir) == []
        os.rename(workdir / "stream.aside", workdir / STREAM)
        sb = await node.resume(sb.id)
        await still_there(sb)


async def test_a_restarted_node_converts_what_the_last_one_did_not(
    settings: Settings, base_template: Any
) -> None:
    async with Node(settings) as node:
        sb = await with_state(node)
        workdir = node.settings.sandboxes_dir / sb.id
        await node.pause(sb.id)
        # As if the server stopped before the conversion got anywhere.
        await node.conversions.cancel(sb.id)
    # The stream is still what the sandbox is.
    assert kind_of(workdir) == "stream" and leftovers(workdir) == []
    async with Node(settings) as node:
        assert node.conversions.busy(sb.id)
        await node.conversions.wait(sb.id)
        assert kind_of(workdir) == "state"
        sb = await node.resume(sb.id)
        await still_there(sb)
