"""Boot the cached guest artifacts with a raw QEMU (no vmm/ code) and reach envd.

The guest's NIC is QEMU user networking in restricted mode: no route out of the VM, one
forwarded port on 127.0.0.1 to envd, and the guest address plan of a real sandbox.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from agentenv.config import Settings
from agentenv.guest.envd.client import EnvdClient
from agentenv.ports import ENVD_PORT
from agentenv.storage.layers import LayerStore
from agentenv.template.artifacts import GuestArtifacts, guest_args, kernel_cmdline
from agentenv.template.rootfs import ensure_base
from agentenv.vmm.accel import TCG_BOOT_TIMEOUT_S
from agentenv.vmm.version import microvm_machine, qemu_version

pytestmark = pytest.mark.vm
MARKER = b"agentenv: envd started"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def booted(
    settings: Settings, guest_artifacts: GuestArtifacts, tmp_path: Path
) -> Iterator[tuple[int, Path, float]]:
    base = ensure_base(settings)
    layer = LayerStore(settings.layers_dir).path(base.layers[-1])
    upper = tmp_path / "upper.qcow2"
    subprocess.run(
        # Bigger than the template: the guest init must grow the filesystem to fit.
        [
            "qemu-img",
            "create",
            "-q",
            "-f",
            "qcow2",
            "-F",
            "qcow2",
            "-b",
            str(layer),
            str(upper),
            f"{base.size_mb + 1024}M",
        ],
        check=True,
    )
    port = _free_port()
    net = settings.network
    serial = tmp_path / "serial.log"
    cmdline = kernel_cmdline(
        guest_artifacts, "tcg", guest_args(settings, TCG_BOOT_TIMEOUT_S, hostname="boot-test")
    )
    argv = [
        settings.qemu_binary,
        "-M", microvm_machine(qemu_version(settings.qemu_binary)),
        "-accel", "tcg", "-cpu", "max", "-m", "512", "-smp", "1",
        "-nodefaults", "-no-user-config", "-display", "none", "-no-reboot",
        "-serial", f"file:{serial}",
        "-kernel", str(guest_artifacts.kernel),
        "-append", cmdline,
        "-drive", f"id=root,file={upper},format=qcow2,if=none",
        "-device", "virtio-blk-device,drive=root",
        "-drive", f"id=tools,file={guest_artifacts.tools_image},format=raw,if=none,readonly=on",
        "-device", "virtio-blk-device,drive=tools",
        "-netdev",
        f"user,id=n0,restrict=on,net={net.guest_cidr.network_address}/24,"
        f"host={net.gateway_ip},dhcpstart={net.guest_cidr.network_address + 100},"
        f"hostfwd=tcp:127.0.0.1:{port}-{net.guest_ip}:{ENVD_PORT}",
        "-device", f"virtio-net-device,netdev=n0,mac={net.guest_mac}",
    ]  # fmt: skip
    if guest_artifacts.initramfs is not None:
        argv[argv.index("-append") : argv.index("-append")] = [
            "-initrd",
            str(guest_artifacts.initramfs),
        ]
    t0 = time.monotonic()
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        yield port, serial, t0
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()


def _wait_for_marker(serial: Path, timeout: float) -> float:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if serial.exists() and MARKER in serial.read_bytes():
            return time.monotonic()
        time.sleep(0.05)
    tail = serial.read_bytes()[-2000:].decode(errors="replace") if serial.exists() else ""
    raise AssertionError(f"no envd marker within {timeout}s; serial log ends:\n{tail}")


async def test_artifacts_boot_to_envd(booted: tuple[int, Path, float], settings: Settings) -> None:
    port, serial, t0 = booted
    base_mb = ensure_base(settings).size_mb
    marker_at = await asyncio.to_thread(_wait_for_marker, serial, 120.0)
    async with EnvdClient(f"http://127.0.0.1:{port}") as envd:
        await envd.wait_healthy(timeout=60.0, interval=0.2)
        healthy_at = time.monotonic()
        print(f"\nboot: marker {marker_at - t0:.2f}s, /health {healthy_at - t0:.2f}s")
        res = await envd.run(
            "whoami; sudo -n true && echo sudo-ok; hostname; cat /proc/1/comm;"
            " stat -fc %T /sys/fs/cgroup; ip -4 -o addr show eth0; test -w /tmp && echo tmp-ok;"
            " df -BM --output=size / | tail -1",
            user="user",
        )
    assert res.exit_code == 0, res.stderr
    lines = res.stdout.split("\n")
    # PID 1 is the tools Python, started through its own dynamic loader.
    assert lines[:4] == ["user", "sudo-ok", "boot-test", "ld-linux-x86-64"]
    assert lines[4] == "cgroup2fs"
    assert "169.254.0.2/30" in lines[5]
    assert "tmp-ok" in lines
    assert int(lines[7].strip().rstrip("M")) > base_mb + 512, lines[7]
    log = serial.read_text(errors="replace")
    assert "tools-init:" not in log and "initramfs:" not in log


def test_unmountable_rootfs_powers_off_with_a_message(
    settings: Settings, guest_artifacts: GuestArtifacts, tmp_path: Path
) -> None:
    blank = tmp_path / "blank.raw"
    blank.write_bytes(b"")
    os.truncate(blank, 64 << 20)
    serial = tmp_path / "serial.log"
    argv = [
        settings.qemu_binary,
        "-M", microvm_machine(qemu_version(settings.qemu_binary)),
        "-accel", "tcg", "-cpu", "max", "-m", "256",
        "-nodefaults", "-no-user-config", "-display", "none", "-no-reboot",
        "-serial", f"file:{serial}",
        "-kernel", str(guest_artifacts.kernel),
        *(["-initrd", str(guest_artifacts.initramfs)] if guest_artifacts.initramfs else []),
        "-append", kernel_cmdline(guest_artifacts, "tcg"),
        "-drive", f"id=root,file={blank},format=raw,if=none",
        "-device", "virtio-blk-device,drive=root",
        "-drive", f"id=tools,file={guest_artifacts.tools_image},format=raw,if=none,readonly=on",
        "-device", "virtio-blk-device,drive=tools",
    ]  # fmt: skip
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        proc.wait(timeout=120)  # the guest powers itself off; QEMU must exit on its own
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
    assert "agentenv: tools-init: cannot mount /dev/vda" in serial.read_text(errors="replace")
