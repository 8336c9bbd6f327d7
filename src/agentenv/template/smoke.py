"""Boot a kernel once with a raw QEMU to prove it reaches our guest init.

A custom kernel is preferred automatically once it is in the cache, so it is only published
after this check passes. The guest gets a blank scratch rootfs and no network: all that is
checked is that the kernel finds its virtio disks, mounts the tools layer and runs init.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from agentenv.config import Settings
from agentenv.template.commands import run
from agentenv.template.errors import BuildError
from agentenv.vmm.version import microvm_machine, qemu_version

MARKER = b"agentenv: envd started"


def smoke_boot(
    settings: Settings,
    kernel: Path,
    initramfs: Path | None,
    tools_image: Path,
    cmdline: str,
    timeout: float = 180.0,
) -> float:
    """Seconds from QEMU start to the init marker; BuildError with the console tail if none."""
    with tempfile.TemporaryDirectory(dir=settings.cache, prefix=".smoke-") as scratch:
        root = Path(scratch) / "root.ext4"
        run(["mkfs.ext4", "-q", "-F", "-L", "smoke", root, "64M"])
        serial = Path(scratch) / "serial.log"
        argv = [
            settings.qemu_binary,
            "-M", microvm_machine(qemu_version(settings.qemu_binary)),
            "-accel", "tcg", "-cpu", "max", "-m", "256",
            "-nodefaults", "-no-user-config", "-display", "none", "-no-reboot",
            "-serial", f"file:{serial}",
            "-kernel", str(kernel),
            *(["-initrd", str(initramfs)] if initramfs is not None else []),
            "-append", cmdline,
            "-drive", f"id=root,file={root},format=raw,if=none",
            "-device", "virtio-blk-device,drive=root",
            "-drive", f"id=tools,file={tools_image},format=raw,if=none,readonly=on",
            "-device", "virtio-blk-device,drive=tools",
        ]  # fmt: skip
        if shutil.which(argv[0]) is None:
            raise BuildError(f"{argv[0]} not found (run `aenv setup`)")
        t0 = time.monotonic()
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            while time.monotonic() - t0 < timeout:
                if serial.exists() and MARKER in serial.read_bytes():
                    return time.monotonic() - t0
                if proc.poll() is not None:
                    break
                time.sleep(0.05)
        finally:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
        tail = serial.read_bytes()[-400:].decode(errors="replace") if serial.exists() else ""
        last = " | ".join(line.strip() for line in tail.splitlines()[-3:] if line.strip())
        raise BuildError(
            f"kernel {kernel.name} did not reach the guest init: {last or 'no output'}"
        )
