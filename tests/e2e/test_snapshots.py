"""Snapshots on real microVMs: a template is a snapshot, sandboxes are restores of it, and
pause/resume, persistent snapshots and fork keep what the guest had (files, processes,
listening sockets, memory) while giving each clone its own identity."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from agentenv.config import Settings
from agentenv.guest.envd.client import EnvdClient
from agentenv.network import Slot, create_slot, destroy_slot
from agentenv.snapshot import (
    ForkTarget,
    GuestImage,
    Machine,
    MemoryMode,
    RestoreFailed,
    SnapshotNotFound,
    capture,
    ensure_template_snapshot,
    fork,
    identify,
    pause,
    release,
    repository,
    restore,
    resume,
)
from agentenv.snapshot.templates import template_alias

pytestmark = pytest.mark.vm

MEM = 512
# A process that keeps a random secret only in its memory and hands it to whoever connects.
SECRET_SERVER = (
    "import os, socket\n"
    "secret = os.urandom(8).hex()\n"
    "s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
    "s.bind(('0.0.0.0', 8000)); s.listen()\n"
    "while True:\n"
    "    c, _ = s.accept(); c.sendall(secret.encode()); c.close()\n"
)


@pytest.fixture(scope="session")
def image() -> GuestImage:
    return GuestImage.resolve(Settings.from_env())


@pytest.fixture(scope="session")
def template_snapshot(agentenv_home: Path, base_template: Any, image: GuestImage) -> Any:
    settings = replace(Settings.from_env(), home=agentenv_home)
    t0 = time.monotonic()
    snap = asyncio.run(ensure_template_snapshot(settings, "base", MEM, 1, image))
    print(f"template snapshot built in {time.monotonic() - t0:.1f}s: {snap}")
    return snap


class Sandboxes:
    """Restored guests of one test, each with its slot and workdir; all released at the end."""

    def __init__(self, settings: Settings, image: GuestImage) -> None:
        self.settings = settings
        self.image = image
        self.repo = repository(settings)
        self.machines: dict[str, Machine] = {}
        self.slots: list[Slot] = []
        self.n = 0

    def new_name(self) -> str:
        self.n += 1
        return f"snaptest{self.n}-{int(time.time() * 1000) % 100000}"

    async def slot(self) -> Slot:
        slot = await create_slot(self.settings.network)
        self.slots.append(slot)
        return slot

    def workdir(self, name: str) -> Path:
        return self.settings.sandboxes_dir / name

    async def restore(self, ref: str) -> Machine:
        name = self.new_name()
        m = await restore(
            self.repo,
            self.repo.layers,
            self.image,
            ref,
            name=name,
            workdir=self.workdir(name),
            slot=await self.slot(),
        )
        self.machines[name] = m
        async with EnvdClient(m.envd_url) as envd:
            await identify(envd, hostname=name)
        return m

    async def close(self) -> None:
        for m in self.machines.values():
            with contextlib.suppress(Exception):
                await release(m, self.repo, self.repo.layers)
            shutil.rmtree(m.workdir, ignore_errors=True)
        for slot in self.slots:
            await destroy_slot(slot)
        await asyncio.to_thread(self.repo.gc)


@pytest.fixture
async def sandboxes(
    settings: Settings, image: GuestImage, template_snapshot: Any
) -> AsyncIterator[Sandboxes]:
    sb = Sandboxes(settings, image)
    try:
        yield sb
    finally:
        await sb.close()


async def sh(m: Machine, cmd: str) -> str:
    async with EnvdClient(m.envd_url) as envd:
        code, out, err = await envd.run(cmd, user="root", timeout=60)
    assert code == 0, f"{cmd!r} failed ({code}): {err}"
    return out.strip()


async def secret_of(m: Machine) -> str:
    reader, writer = await asyncio.wait_for(
        asyncio.open_connection(str(m.slot.slot_ip), 8000), timeout=10
    )
    try:
        return (await asyncio.wait_for(reader.read(100), timeout=10)).decode()
    finally:
        writer.close()


async def start_state(m: Machine) -> tuple[str, str, str]:
    """A file, a background process and an in-memory secret; returns what to compare."""
    await sh(m, "echo kept > /root/file")
    await sh(m, f"cat > /tmp/srv.py <<'EOF'\n{SECRET_SERVER}EOF")
    await sh(m, "setsid nohup python3 /tmp/srv.py >/dev/null 2>&1 & echo $! > /tmp/srv.pid")
    pid = await sh(m, "cat /tmp/srv.pid")
    secret = ""
    for _ in range(100):
        with contextlib.suppress(OSError, TimeoutError):
            secret = await secret_of(m)
            break
        await asyncio.sleep(0.1)
    assert len(secret) == 16
    return "kept", pid, secret


async def check_state(m: Machine, want: tuple[str, str, str]) -> None:
    text, pid, secret = want
    assert await sh(m, "cat /root/file") == text
    assert await sh(m, f"test -d /proc/{pid} && cat /proc/{pid}/cmdline | tr '\\0' ' '") == (
        "python3 /tmp/srv.py"
    )
    assert await secret_of(m) == secret


async def test_template_snapshot_is_cached(
    settings: Settings, image: GuestImage, template_snapshot: Any
) -> None:
    t0 = time.monotonic()
    again = await ensure_template_snapshot(settings, "base", MEM, 1, image)
    assert again.id == template_snapshot.id
    assert time.monotonic() - t0 < 2.0
    snap = repository(settings).get(template_alias("base", 1, MEM))
    assert snap.id == template_snapshot.id and snap.source == "template:base"
    assert snap.memory_mb == MEM and snap.accel == image.accel.name
    # Only device state is stored besides the RAM image, whose never-touched pages are holes.
    assert snap.state_bytes < 1024 * 1024
    assert 0 < snap.memory_bytes < MEM * 1024 * 1024


async def test_restore_gives_a_new_identity(sandboxes: Sandboxes, template_snapshot: Any) -> None:
    t0 = time.monotonic()
    a = await sandboxes.restore(template_snapshot.id)
    took = time.monotonic() - t0
    print(f"restore + identity: {took:.3f}s")
    assert took < 10
    b = await sandboxes.restore(template_snapshot.id)
    assert a.memory is MemoryMode.SNAPSHOT
    assert await sh(a, "hostname") == a.name
    assert await sh(b, "hostname") == b.name
    # The clock follows the host, not the moment of capture.
    assert abs(float(await sh(a, "date +%s.%N")) - time.time()) < 5
    ra = await sh(a, "head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \\n'")
    rb = await sh(b, "head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \\n'")
    assert ra != rb
    # Clones write privately: one's disk and memory are not the other's.
    await sh(a, "echo mine > /root/only-a")
    assert await sh(b, "test -e /root/only-a && echo yes || echo no") == "no"


async def test_pause_resume_ten_cycles(sandboxes: Sandboxes, template_snapshot: Any) -> None:
    m = await sandboxes.restore(template_snapshot.id)
    want = await start_state(m)
    name, workdir = m.name, m.workdir
    times: list[tuple[float, float]] = []
    for cycle in range(10):
        t0 = time.monotonic()
        record = await pause(m, sandboxes.repo, sandboxes.image)
        t1 = time.monotonic()
        assert m.vm.exit_code is not None, "QEMU must exit on pause"
        assert record.kind == ("stream" if cycle == 0 else "state")
        # Resume on a different slot: the guest side of every slot is identical.
        m = await resume(workdir, sandboxes.image, await sandboxes.slot())
        sandboxes.machines[name] = m
        times.append((t1 - t0, time.monotonic() - t1))
        assert m.memory is MemoryMode.OWN
        await check_state(m, want)
        await sh(m, f"echo {cycle} >> /root/cycles")
    assert (await sh(m, "cat /root/cycles")).split() == [str(i) for i in range(10)]
    print("pause/resume s:", [f"{p:.3f}/{r:.3f}" for p, r in times])
    # After the first cycle the sandbox no longer maps the template's memory.
    snap = sandboxes.repo.get(template_snapshot.id)
    assert name not in snap.holders


async def test_snapshot_of_a_running_sandbox(sandboxes: Sandboxes, template_snapshot: Any) -> None:
    src = await sandboxes.restore(template_snapshot.id)
    want = await start_state(src)
    cap = await capture(
        src,
        sandboxes.repo,
        sandboxes.repo.layers,
        sandboxes.image,
        keep_running=True,
        names=["snaptest-persist"],
    )
    print(f"capture of a restored sandbox: stopped {cap.stopped_s:.3f}s, total {cap.total_s:.3f}s")
    assert cap.snapshot.parent == template_snapshot.id
    # The source keeps running with everything it had.
    await check_state(src, want)
    await sh(src, "echo after > /root/file")
    child = await sandboxes.restore("snaptest-persist")
    await check_state(child, want)
    assert await sh(child, "hostname") == child.name
    # Deleting a snapshot that a sandbox maps only hides it until that sandbox lets go.
    snap_dir = sandboxes.repo.root / cap.snapshot.id
    sandboxes.repo.delete("snaptest-persist")
    with pytest.raises(SnapshotNotFound):
        sandboxes.repo.get("snaptest-persist")
    assert (snap_dir / "memory").exists()
    # Snapshot of a resumed sandbox (own memory file): device state only, re-homed.
    await pause(child, sandboxes.repo, sandboxes.image)
    child = await resume(child.workdir, sandboxes.image, child.slot)
    sandboxes.machines[child.name] = child
    cap2 = await capture(
        child, sandboxes.repo, sandboxes.repo.layers, sandboxes.image, keep_running=True
    )
    print(f"capture of a resumed sandbox: stopped {cap2.stopped_s:.3f}s")
    assert child.memory is MemoryMode.SNAPSHOT and child.snapshot_id == cap2.snapshot.id
    await check_state(child, want)
    grandchild = await sandboxes.restore(cap2.snapshot.id)
    await check_state(grandchild, want)
    for m in (child, grandchild):
        await release(m, sandboxes.repo, sandboxes.repo.layers)
    sandboxes.repo.gc()
    assert not snap_dir.exists()


async def test_fork_children_differ(sandboxes: Sandboxes, template_snapshot: Any) -> None:
    src = await sandboxes.restore(template_snapshot.id)
    want = await start_state(src)
    targets = []
    for _ in range(3):
        name = sandboxes.new_name()
        targets.append(ForkTarget(name, sandboxes.workdir(name), await sandboxes.slot()))
    res = await fork(src, targets, sandboxes.repo, sandboxes.repo.layers, sandboxes.image)
    for c in res.children:
        sandboxes.machines[c.name] = c
    print(f"fork of 3: stopped {res.capture.stopped_s:.3f}s, total {res.total_s:.3f}s")
    await check_state(src, want)
    names, rand = set(), set()
    for c in res.children:
        await check_state(c, want)
        names.add(await sh(c, "hostname"))
        rand.add(await sh(c, "head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \\n'"))
    assert names == {t.name for t in targets}
    assert len(rand) == 3, "clones must not share their RNG output"


async def test_bad_input_leaves_nothing(
    sandboxes: Sandboxes, template_snapshot: Any, tmp_path: Path
) -> None:
    slot = await sandboxes.slot()
    with pytest.raises(SnapshotNotFound, match="does not exist"):
        await restore(
            sandboxes.repo,
            sandboxes.repo.layers,
            sandboxes.image,
            "no-such-snapshot",
            name="x",
            workdir=sandboxes.workdir("x"),
            slot=slot,
        )
    assert not sandboxes.workdir("x").exists()
    with pytest.raises(RestoreFailed, match="not paused"):
        await resume(tmp_path, sandboxes.image, slot)
