"""Balloon rules of QemuVM that hold before any guest runs: which device a VM gets, and which
balloon moves are refused (the guest-side effects are in tests/orchestrator/test_memory.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from agentenv.config import Settings
from agentenv.vmm.accel import detect
from agentenv.vmm.base import BootSource, MachineSpec
from agentenv.vmm.errors import BalloonUnsupported, VMMError
from agentenv.vmm.qemu import QemuVM, balloon_device

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


def test_free_page_reporting_only_for_anonymous_ram(tmp_path: Path) -> None:
    anon = balloon_device(MachineSpec(1, 256))
    own = balloon_device(MachineSpec(1, 256, mem_file=tmp_path / "m", mem_shared=True))
    clone = balloon_device(MachineSpec(1, 256, mem_file=tmp_path / "m", mem_shared=False))
    assert "free-page-reporting=on" in anon and "deflate-on-oom=on" in anon
    # Every VM that saves or loads a snapshot has a memory file: one device set for all.
    assert own == clone
    assert "free-page-reporting" not in own and "deflate-on-oom=on" in own


def test_argv_carries_the_balloon_device(settings: Settings, tmp_path: Path) -> None:
    spec = MachineSpec(1, 256, mem_file=tmp_path / "m", mem_shared=False)
    argv = vm(settings, tmp_path, spec).argv()
    assert argv[argv.index(balloon_device(spec)) - 1] == "-device"
    no_balloon = vm(settings, tmp_path, MachineSpec(1, 256, balloon=False)).argv()
    assert not any("virtio-balloon" in a for a in no_balloon)


@pytest.mark.parametrize(
    ("spec", "reclaims"),
    [
        ({}, True),
        ({"mem_shared": True}, True),
        ({"mem_shared": False}, False),
    ],
)
async def test_inflation_is_refused_where_it_would_punch_a_shared_file(
    settings: Settings, tmp_path: Path, spec: dict[str, Any], reclaims: bool
) -> None:
    if spec:
        spec = {**spec, "mem_file": tmp_path / "m"}
    machine = vm(settings, tmp_path, MachineSpec(1, 256, **spec))
    assert machine.balloon_reclaims is reclaims
    if not reclaims:
        with pytest.raises(BalloonUnsupported, match="punch holes"):
            await machine.balloon_set(128 * MIB)
    # Past the safety check an unstarted VM has no monitor to ask.
    with pytest.raises(VMMError, match="not running"):
        await machine.balloon_set(256 * MIB)


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
