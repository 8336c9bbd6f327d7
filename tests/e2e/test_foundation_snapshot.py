"""Memory snapshot of a live sandbox guest and restore into a new QEMU (microvm-notes §3)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from agentenv.config import Settings
from agentenv.guest.envd.client import EnvdClient
from agentenv.network import create_slot, destroy_slot
from agentenv.storage import LayerStore, create_upper
from agentenv.template import artifacts
from agentenv.vmm.accel import boot_deadline, detect
from agentenv.vmm.base import BootSource, Drive, MachineSpec, NetIface, VMStatus
from agentenv.vmm.errors import VMMError
from agentenv.vmm.qemu import QemuVM
from agentenv.vmm.ramshim import ensure_ram_shim

pytestmark = pytest.mark.vm


async def wait_health(url: str, vm: QemuVM, limit_s: float) -> None:
    deadline = time.monotonic() + limit_s
    async with httpx.AsyncClient(timeout=2.0, trust_env=False) as http:
        while time.monotonic() < deadline:
            assert vm.exit_code is None, "VM exited"
            try:
                if (await http.get(f"{url}/health")).is_success:
                    return
            except httpx.TransportError:
                pass
            await asyncio.sleep(0.1)
    raise AssertionError(f"{url} not healthy in {limit_s}s")


async def test_snapshot_and_restore_a_running_guest(
    settings: Settings, guest_artifacts: Any, base_template: Any, tmp_path: Path
) -> None:
    accel = detect(settings)
    store = LayerStore(settings.layers_dir)
    upper = tmp_path / "rootfs.qcow2"
    await create_upper(store.path(base_template.layers[-1]), upper, None)
    mem = tmp_path / "memory"
    state = tmp_path / "state"
    deadline = boot_deadline(settings, accel)
    cmdline = artifacts.kernel_cmdline(
        guest_artifacts, accel.name, artifacts.guest_args(settings, deadline, hostname="snap")
    )
    slot = await create_slot(settings.network)
    try:

        def vm(name: str, shared: bool, incoming: bool) -> QemuVM:
            return QemuVM(
                name=name,
                workdir=tmp_path / name,
                machine=MachineSpec(vcpus=1, memory_mb=384, mem_file=mem, mem_shared=shared),
                boot=BootSource(guest_artifacts.kernel, guest_artifacts.initramfs, cmdline),
                drives=[
                    Drive("vda", upper, read_only=False),
                    Drive("vdb", guest_artifacts.tools_image, read_only=True, fmt="raw"),
                ],
                accel=accel,
                net=NetIface(slot.tap, slot.guest_mac),
                netns=slot.netns,
                incoming=incoming,
                ram_shim=ensure_ram_shim(settings.cache),
            )

        url = f"http://{slot.slot_ip}:49983"
        first = vm("snap-a", shared=True, incoming=False)
        await first.start()
        try:
            await wait_health(url, first, deadline)
            async with EnvdClient(url) as envd:
                assert (await envd.run("echo before > /root/mark", user="root"))[0] == 0
            t0 = time.monotonic()
            await first.snapshot_create(state)
            took = time.monotonic() - t0
            assert await first.status() == VMStatus.PAUSED
            assert 0 < state.stat().st_size < 4 * 1024 * 1024, "state must not hold the RAM"
            print(f"snapshot_create: {took * 1000:.1f} ms, state {state.stat().st_size} bytes")
        finally:
            await first.kill()

        second = vm("snap-b", shared=False, incoming=True)
        t0 = time.monotonic()
        await second.start()
        try:
            assert await second.status() == VMStatus.CREATED
            await second.snapshot_load(state)
            assert await second.status() == VMStatus.RUNNING
            print(f"restore spawn → running: {(time.monotonic() - t0) * 1000:.0f} ms")
            await wait_health(url, second, 60)
            print(f"restore spawn → healthy: {(time.monotonic() - t0) * 1000:.0f} ms")
            async with EnvdClient(url) as envd:
                code, out, _ = await envd.run("cat /root/mark; hostname", user="root")
            assert code == 0 and out.split() == ["before", "snap"]
            # A VM that was booted normally refuses to load a snapshot.
            with pytest.raises(VMMError, match="not started to receive"):
                await first.snapshot_load(state)
        finally:
            await second.kill()
    finally:
        await destroy_slot(slot)
