"""QemuVM against real QEMU: lifecycle, QMP control, cgroup and netns placement, sealing.

The guest is the real kernel with no root disk: it boots, prints to the serial log and then
waits forever at "unable to mount root", which is all these tests need of it.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from agentenv.config import NetworkPlan, Settings
from agentenv.network import create_slot, destroy_slot
from agentenv.storage import create_upper_sync, info
from agentenv.vmm.accel import detect
from agentenv.vmm.base import BootSource, DiskLimits, Drive, MachineSpec, NetIface, VMStatus
from agentenv.vmm.errors import VMStartError
from agentenv.vmm.qemu import QemuVM, memory_overhead_mb

pytestmark = pytest.mark.vm

MIB = 1024 * 1024


def make_vm(settings: Settings, arts: Any, workdir: Path, **kw: Any) -> QemuVM:
    defaults: dict[str, Any] = {
        # The pid: the other xdist worker makes VMs of the same workdir name at the same time,
        # and a cgroup named as one this process made counts as this process's leftover.
        "name": f"vmtest-{os.getpid()}-{workdir.name[-8:]}",
        "workdir": workdir,
        "machine": MachineSpec(vcpus=1, memory_mb=128),
        "boot": BootSource(arts.kernel, None, "console=ttyS0 panic=0"),
        "drives": [],
        "accel": detect(settings),
    }
    defaults.update(kw)
    return QemuVM(**defaults)


def run(*argv: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(a) for a in argv], capture_output=True, text=True, check=False)


async def wait_for(pred: Any, limit_s: float = 60.0) -> None:
    for _ in range(int(limit_s / 0.1)):
        if pred():
            return
        await asyncio.sleep(0.1)
    raise AssertionError("condition not met in time")


async def test_lifecycle_cgroup_and_serial(
    settings: Settings, guest_artifacts: Any, tmp_path: Path
) -> None:
    vm = make_vm(settings, guest_artifacts, tmp_path / "vm", machine=MachineSpec(2, 160))
    await vm.start()
    try:
        assert vm.pid is not None
        assert await vm.status() == VMStatus.RUNNING
        assert vm.cgroup is not None
        assert vm.pid in vm.cgroup.pids()
        for d in vm.cgroup.dirs:
            if d.parent.parent.name == "memory":
                limit = int((d / "memory.limit_in_bytes").read_text())
                assert limit == (160 + memory_overhead_mb(vm.accel)) * MIB
            if d.parent.parent.name == "cpu":
                assert (d / "cpu.cfs_quota_us").read_text().strip() == "200000"
        await wait_for(lambda: "Linux version" in vm.serial_log.read_text(errors="replace"))
        await vm.pause()
        assert await vm.status() == VMStatus.PAUSED
        await vm.resume()
        assert await vm.status() == VMStatus.RUNNING
    finally:
        await vm.kill()
    assert vm.exit_code is not None
    assert await vm.status() == VMStatus.STOPPED
    assert not vm.qmp_socket.exists()
    assert all(not d.exists() for d in vm.cgroup.dirs)


async def test_stop_falls_back_to_kill(
    settings: Settings, guest_artifacts: Any, tmp_path: Path
) -> None:
    # A guest with no userspace ignores the power button; stop() must still end it.
    vm = make_vm(settings, guest_artifacts, tmp_path / "vm")
    await vm.start()
    await vm.stop(grace_s=0.5)
    assert vm.exit_code is not None
    assert not vm.qmp_socket.exists()


async def test_runs_inside_the_slot_netns(
    settings: Settings, guest_artifacts: Any, tmp_path: Path
) -> None:
    slot = await create_slot(NetworkPlan())
    try:
        vm = make_vm(
            settings,
            guest_artifacts,
            tmp_path / "vm",
            net=NetIface(slot.tap, slot.guest_mac),
            netns=slot.netns,
        )
        await vm.start()
        try:
            assert vm.pid is not None
            ns_of_qemu = os.stat(f"/proc/{vm.pid}/ns/net").st_ino
            assert ns_of_qemu == os.stat(slot.netns_path).st_ino
            assert ns_of_qemu != os.stat("/proc/self/ns/net").st_ino
            # QEMU holds the tap open: the kernel reports carrier on it.
            out = run("ip", "-n", slot.netns, "-br", "link", "show", "tap0").stdout
            assert "LOWER_UP" in out
        finally:
            await vm.kill()
    finally:
        await destroy_slot(slot)


async def test_seal_disk_makes_old_upper_read_only(
    settings: Settings, guest_artifacts: Any, tmp_path: Path
) -> None:
    base = tmp_path / "base.qcow2"
    assert run("qemu-img", "create", "-q", "-f", "qcow2", base, "32M").returncode == 0
    upper = tmp_path / "upper.qcow2"
    create_upper_sync(base, upper, 64)
    vm = make_vm(
        settings,
        guest_artifacts,
        tmp_path / "vm",
        drives=[Drive("vda", upper, read_only=False)],
    )
    await vm.start()
    try:
        # In the VM's workdir: a confined QEMU sees nothing else of the host.
        new_upper = vm.workdir / "upper2.qcow2"
        sealed = await vm.seal_disk("vda", new_upper)
        assert sealed == upper
        assert vm.disk_path("vda") == new_upper
        assert upper.stat().st_mode & 0o777 == 0o444
        assert info(new_upper).backing_file == upper
        assert info(new_upper).virtual_size == 64 * MIB
        # QEMU keeps writing to the new upper only: another reader may open the sealed layer
        # without -U (no write lock is held on it any more).
        probe = run("qemu-img", "info", upper)
        assert probe.returncode == 0, probe.stderr
        locked = run("qemu-img", "info", new_upper)
        assert locked.returncode != 0 and "lock" in locked.stderr
        with pytest.raises(Exception, match="exists"):
            await vm.seal_disk("vda", new_upper)
        assert vm.disk_path("vda") == new_upper
    finally:
        await vm.kill()


@pytest.mark.parametrize("incoming", [False, True], ids=["boot", "incoming"])
async def test_disk_limits_on_writable_drives_survive_a_seal(
    settings: Settings, guest_artifacts: Any, tmp_path: Path, incoming: bool
) -> None:
    base = tmp_path / "base.qcow2"
    assert run("qemu-img", "create", "-q", "-f", "qcow2", base, "32M").returncode == 0
    upper = tmp_path / "upper.qcow2"
    create_upper_sync(base, upper, 64)
    tools = tmp_path / "tools.raw"
    tools.write_bytes(b"\0" * MIB)
    limits = DiskLimits(bytes_per_s=5 * MIB, iops=300)
    vm = make_vm(
        settings,
        guest_artifacts,
        tmp_path / "vm",
        drives=[Drive("vda", upper, read_only=False), Drive("vdb", tools, True, "raw")],
        disk_limits=limits,
        # A restore's QEMU waits for its state: the limits are set before it ever runs.
        incoming=incoming,
    )
    await vm.start()
    try:
        # Only the writable drive: the read-only tools layer is shared and in page cache.
        assert await vm.disk_limits_in_effect() == {"vda": limits, "vdb": DiskLimits()}
        assert vm.spec()["disk_limits"] == {"bytes_per_s": 5 * MIB, "iops": 300}
        if not incoming:
            # A seal puts a new top under the device's backend; the limit stays with it.
            await vm.seal_disk("vda", vm.workdir / "upper2.qcow2")
            assert (await vm.disk_limits_in_effect())["vda"] == limits
        await vm.set_disk_limits(None)
        assert (await vm.disk_limits_in_effect())["vda"] == DiskLimits()
        assert vm.spec()["disk_limits"] is None
    finally:
        await vm.kill()


async def test_bad_inputs_leave_nothing(
    settings: Settings, guest_artifacts: Any, tmp_path: Path
) -> None:
    vm = make_vm(
        settings,
        guest_artifacts,
        tmp_path / "vm",
        boot=BootSource(tmp_path / "missing-kernel", None, ""),
    )
    with pytest.raises(VMStartError, match="does not exist"):
        await vm.start()
    # QEMU itself refuses: a raw "image" that is not there at the block layer is caught
    # before spawn; a corrupt qcow2 is only caught by QEMU.
    bad = tmp_path / "bad.qcow2"
    bad.write_bytes(b"QFI\xfb" + b"\0" * 60)
    vm = make_vm(
        settings, guest_artifacts, tmp_path / "vm2", drives=[Drive("vda", bad, read_only=True)]
    )
    with pytest.raises(VMStartError, match="qemu exited"):
        await vm.start()
    assert vm.cgroup is not None and all(not d.exists() for d in vm.cgroup.dirs)
    assert not vm.qmp_socket.exists()
