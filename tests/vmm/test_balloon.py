"""Balloon rules of QemuVM that hold before any guest runs: which device a VM gets, and which
balloon moves are refused (the guest-side effects are in tests/node/test_memory.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from agentenv.config import Settings
from agentenv.vmm.accel import detect
from agentenv.vmm.base import BootSource, MachineSpec
from agentenv.vmm.errors import BalloonUnsupported, VMMError, VMStartError
from agentenv.vmm.qemu import QemuVM
from agentenv.vmm.qemu_argv import BALLOON_DEVICE

MIB = 1024 * 1024


def vm(settings: Settings, tmp_path: Path, machine: MachineSpec) -> QemuVM:
    return QemuVM(
        name="balloon-rules",
        workdir=tmp_path,
        machine=machine,
        boot=BootSource(tmp_path / "no-kernel", None, ""),
        drives=[],
        accel=detect(settings),
    )


def test_every_guest_gets_the_same_balloon_device(settings: Settings, tmp_path: Path) -> None:
    specs = [
        MachineSpec(1, 256),
        MachineSpec(1, 256, mem_file=tmp_path / "m", mem_shared=True),
        MachineSpec(1, 256, mem_file=tmp_path / "m", mem_shared=False),
    ]
    assert "free-page-reporting=on" in BALLOON_DEVICE and "deflate-on-oom=on" in BALLOON_DEVICE
    # Every VM that saves or loads a snapshot gets the same device set.
    for spec in specs:
        argv = vm(settings, tmp_path, spec).argv()
        assert argv[argv.index(BALLOON_DEVICE) - 1] == "-device"
        assert sum("virtio-balloon" in a for a in argv) == 1
    no_balloon = vm(settings, tmp_path, MachineSpec(1, 256, balloon=False)).argv()
    assert not any("virtio-balloon" in a for a in no_balloon)


def test_only_a_clone_runs_with_the_ram_preload_library(settings: Settings, tmp_path: Path) -> None:
    shim = tmp_path / "ramshim.so"
    shim.write_bytes(b"")
    mem = tmp_path / "m"
    clone = vm(settings, tmp_path, MachineSpec(1, 256, mem_file=mem, mem_shared=False))
    clone.ram_shim = shim
    plan = clone._launch_plan()
    assert plan["env"] == {"LD_PRELOAD": str(shim), "AGENTENV_PRIVATE_RAM": str(mem)}
    assert plan["argv"][0] == settings.qemu_binary
    own = vm(settings, tmp_path, MachineSpec(1, 256, mem_file=mem, mem_shared=True))
    own.ram_shim = shim
    assert own._launch_plan()["env"] == {}


async def test_a_clone_without_the_library_does_not_start(
    settings: Settings, tmp_path: Path
) -> None:
    (tmp_path / "no-kernel").write_bytes(b"")
    clone = vm(settings, tmp_path, MachineSpec(1, 256, mem_file=tmp_path / "m", mem_shared=False))
    with pytest.raises(VMStartError, match="RAM preload library"):
        await clone.start()
    assert clone.pid is None


@pytest.mark.parametrize("target", [0, -1, 257 * MIB])
async def test_targets_outside_the_guest_are_refused(
    settings: Settings, tmp_path: Path, target: int
) -> None:
    machine = vm(settings, tmp_path, MachineSpec(1, 256))
    with pytest.raises(VMMError, match="outside"):
        await machine.balloon_set(target)


async def test_no_balloon_device_is_a_clear_error(settings: Settings, tmp_path: Path) -> None:
    machine = vm(settings, tmp_path, MachineSpec(1, 256, balloon=False))
    with pytest.raises(BalloonUnsupported, match="no balloon"):
        await machine.balloon_set(128 * MIB)
    with pytest.raises(BalloonUnsupported, match="no balloon"):
        await machine.balloon_query()
