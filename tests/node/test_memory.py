"""Host memory of sandboxes on real microVMs: PSS, page sharing between clones, balloons of
idle sandboxes, host-pressure reclaim (the idlest first), activity deflating, captures holding
the manager off, and the template snapshot staying intact whatever a clone frees.

Host memory pressure cannot be produced on a shared machine without hurting everyone on it,
so the pressure tests feed the manager a reading; everything else is the real thing.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any

import pytest

from agentenv.config import Settings
from agentenv.config_env import ConfigError
from agentenv.guest.envd.client import EnvdClient
from agentenv.node.host import Node, SandboxHandle
from agentenv.node.memory import (
    DEFLATED_SLACK,
    HostPressure,
    MemoryManager,
    MemoryPolicy,
    host_memory,
    read_pressure,
)
from agentenv.snapshot.digest import sparse_digest

MIB = 1024 * 1024
MEM = 512
FLOOR = 128
TOUCH_MB = 256


def quiet(settings: Settings) -> Settings:
    """The node's own manager stays out of the way; the tests drive managers of their own."""
    return replace(settings, idle_reclaim_s=0, memory_pressure_pct=0)


async def sh(sb: SandboxHandle, cmd: str) -> str:
    async with EnvdClient(sb.envd_url) as envd:
        code, out, err = await envd.run(cmd, user="root", timeout=120)
    assert code == 0, f"{cmd!r}: {err}"
    return out.strip()


async def touch(sb: SandboxHandle, mb: int) -> None:
    """Fill `mb` MiB of the guest's page cache. Memory a guest frees goes back to the host by
    itself (free page reporting); cached file pages stay until the balloon makes the guest
    drop them."""
    await sh(
        sb,
        f"dd if=/dev/zero of=/var/tmp/fill bs=1M count={mb} status=none && sync"
        " && cat /var/tmp/fill > /dev/null",
    )


def pss(sb: SandboxHandle) -> int:
    assert sb.pid is not None
    mem = host_memory(sb.pid)
    assert mem is not None
    return mem.pss


async def until(check: Callable[[], Awaitable[bool]], what: str, limit_s: float = 120.0) -> None:
    for _ in range(int(limit_s / 0.25)):
        if await check():
            return
        await asyncio.sleep(0.25)
    raise AssertionError(f"{what}: not reached within {limit_s:.0f}s")


def at_most(sb: SandboxHandle, target: int) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        return await sb.vm.balloon_query() <= target + DEFLATED_SLACK

    return check


def deflated(sb: SandboxHandle) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        return await sb.vm.balloon_query() >= sb.memory_mb * MIB - DEFLATED_SLACK

    return check


# -- host side, no VM --------------------------------------------------------------------------


def test_host_memory_of_a_process_and_of_none() -> None:
    me = host_memory(os.getpid())
    assert me is not None and 0 < me.pss <= me.rss
    child = subprocess.Popen(["true"])
    child.wait()
    assert host_memory(child.pid) is None


def test_host_pressure_reads_this_host() -> None:
    hp = read_pressure()
    assert hp.total > hp.available > 0
    assert 0.0 < hp.used_fraction < 1.0
    if os.path.exists("/proc/pressure/memory"):
        assert hp.psi_some_avg10 is not None


@pytest.mark.parametrize(
    ("name", "value", "needle"),
    [
        ("AGENTENV_BALLOON_FLOOR_MB", "10", "at least 64"),
        ("AGENTENV_MEMORY_PRESSURE_PCT", "150", "0..100"),
        ("AGENTENV_IDLE_RECLAIM_S", "-1", "or more"),
        ("AGENTENV_IDLE_RECLAIM_S", "soon", "not an integer"),
    ],
)
def test_bad_memory_settings_are_one_line_errors(
    monkeypatch: pytest.MonkeyPatch, name: str, value: str, needle: str
) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match=needle) as err:
        Settings.from_env()
    assert "\n" not in str(err.value)


def test_memory_settings_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    s = Settings.from_env()
    assert (s.idle_reclaim_s, s.balloon_floor_mb, s.memory_pressure_pct) == (60.0, 128, 80.0)
    monkeypatch.setenv("AGENTENV_IDLE_RECLAIM_S", "0")
    monkeypatch.setenv("AGENTENV_BALLOON_FLOOR_MB", "256")
    monkeypatch.setenv("AGENTENV_MEMORY_PRESSURE_PCT", "0")
    s = Settings.from_env()
    assert (s.idle_reclaim_s, s.balloon_floor_mb, s.memory_pressure_pct) == (0.0, 256, 0.0)


# -- on microVMs -------------------------------------------------------------------------------


@pytest.mark.vm
async def test_idle_inflates_activity_deflates_pressure_takes_the_idlest_hold_keeps_off(
    settings: Settings, base_template: Any
) -> None:
    # Clones of the template (a restore each; a cold boot costs ~10 s more CPU under TCG):
    # the balloon gives their pages back as it does a cold-booted guest's.
    node = Node(quiet(settings))
    await node.start()
    managers: list[MemoryManager] = []
    try:
        a = await node.create("base", memory_mb=MEM)
        b = await node.create("base", memory_mb=MEM)
        assert a.vm.balloon_reclaims and b.vm.balloon_reclaims
        await touch(a, TOUCH_MB)
        await touch(b, TOUCH_MB)
        before = pss(a)

        idle = MemoryManager(node.list, MemoryPolicy(idle_s=2, floor_mb=FLOOR, pressure_pct=0))
        managers.append(idle)
        await idle.tick()
        assert idle.inflations == 0, "nothing is idle at first sight"
        await asyncio.sleep(2.5)
        idle.note_activity(b.id)
        await idle.tick()
        assert idle.balloon_target(a.id) == FLOOR * MIB
        assert idle.balloon_target(b.id) is None, "b was just active"
        await until(at_most(a, FLOOR * MIB), "a inflated to the floor")
        after = pss(a)
        print(f"idle sandbox PSS {before / MIB:.0f} -> {after / MIB:.0f} MiB")
        assert after < before - 100 * MIB
        assert await sh(a, "echo alive") == "alive"

        idle.note_activity(a.id)
        await until(deflated(a), "a deflated after activity")
        assert idle.balloon_target(a.id) is None and idle.deflations == 1

        pressured = True

        def reading() -> HostPressure:
            return HostPressure(100, 10 if pressured else 90, None)

        host = MemoryManager(
            node.list,
            MemoryPolicy(idle_s=0, floor_mb=FLOOR, pressure_pct=80, pressure_min_idle_s=1),
            pressure=reading,
        )
        managers.append(host)
        await host.tick()
        assert host.inflations == 0
        await asyncio.sleep(1.5)
        host.note_activity(a.id)
        await host.tick()
        assert host.balloon_target(b.id) == FLOOR * MIB, "b is the idlest"
        assert host.balloon_target(a.id) is None
        await host.tick()
        assert host.balloon_target(a.id) is None, "a was active within pressure_min_idle_s"
        pressured = False
        await asyncio.sleep(1.5)
        await host.tick()
        assert host.balloon_target(a.id) is None, "no pressure, no reclaim"
        await until(at_most(b, FLOOR * MIB), "b inflated under pressure")

        # A capture holds the manager off: deflated on entry, left alone while held.
        async with host.hold(b.id):
            assert await deflated(b)()
            assert host.balloon_target(b.id) is None
            pressured = True
            await host.tick()
            assert host.balloon_target(b.id) is None
            assert host.balloon_target(a.id) == FLOOR * MIB
    finally:
        for m in managers:
            await m.close()
        await node.close()


@pytest.mark.vm
async def test_clones_share_pages_balloon_and_leave_the_template_intact(
    settings: Settings, base_template: Any
) -> None:
    node = Node(quiet(settings))
    cold_node: Node | None = None
    await node.start()
    try:
        c1 = await node.create("base", memory_mb=MEM)
        c2 = await node.create("base", memory_mb=MEM)
        # The second may come from the warm pool the first one started for this shape.
        assert c1.origin == "restore" and c2.origin in ("restore", "warm")
        # A larger disk than the template's is a restore too (grown online), so the cold
        # boot to compare with comes from a node without snapshots.
        bigger = await node.create("base", memory_mb=MEM, disk_size_mb=c1.disk_size_mb + 64)
        assert bigger.origin in ("restore", "warm")
        await node.delete(bigger.id)
        cold_node = Node(quiet(settings), snapshots=False, mem_file=True)
        await cold_node.start()
        cold = await cold_node.create("base", memory_mb=MEM)
        assert cold.origin == "boot"
        for sb in (c1, c2, cold):
            await sh(sb, "true")
        clones = [pss(c1), pss(c2)]
        cold_pss = pss(cold)
        print(
            f"PSS clones {clones[0] / MIB:.0f} + {clones[1] / MIB:.0f} MiB, "
            f"cold boot {cold_pss / MIB:.0f} MiB (memory {MEM} MiB)"
        )
        # Two clones split the template pages they touched; measured here at about half of a
        # cold boot (103-106 MiB vs 206-208 MiB), so the bound leaves room for noise.
        for p in clones:
            assert p < MEM * MIB / 4
            assert p < cold_pss * 3 / 4
        mem = await node.host_memory(c1.id)
        assert mem is not None and mem.pss_file > 0, "a clone maps the template file"

        snap_id = c1.machine.snapshot_id if c1.machine else None
        assert snap_id is not None
        template_file = node.repo.memory_path(snap_id)
        digest = sparse_digest(template_file)
        # Make the clone's RAM its own (copy-on-write), then free it again in the guest.
        await touch(c1, TOUCH_MB)
        before = pss(c1)
        assert c1.vm.balloon_reclaims
        await c1.vm.balloon_set(FLOOR * MIB)
        await until(at_most(c1, FLOOR * MIB), "the clone inflated to the floor")
        after = pss(c1)
        print(f"clone PSS {before / MIB:.0f} -> {after / MIB:.0f} MiB at the floor")
        assert after < before - 100 * MIB
        assert await sh(c1, "echo alive") == "alive"
        await c1.vm.balloon_set(MEM * MIB)
        await until(deflated(c1), "the clone deflated")
        await touch(c1, TOUCH_MB)
        # Free what the clone inherited from the template and let the guest report it.
        await sh(
            c1, "sync; echo 3 > /proc/sys/vm/drop_caches; echo 1 > /proc/sys/vm/compact_memory"
        )
        await asyncio.sleep(5)
        assert sparse_digest(template_file) == digest, "a clone changed the template's RAM"
        c3 = await node.create("base", memory_mb=MEM)
        assert await sh(c3, "python3 -c 'print(6 * 7)'") == "42"
    finally:
        if cold_node is not None:
            await cold_node.close()
        await node.close()
