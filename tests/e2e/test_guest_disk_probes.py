"""From inside a guest, as root: another sandbox's disk and memory are out of reach.

Sandbox B writes a random token to a file on its disk (synced to its upper on the host).
Sandbox A, as root, has only its own disk and the shared read-only tools disk; the block of
its disk at the place B's file lives holds A's data, not B's token, and the tools disk holds
no trace of it; A cannot write the tools disk even after flipping the kernel's read-only flag;
B's data is untouched. Guest RAM is a host file of each guest's QEMU, beyond any device a
guest has; that A's QEMU cannot open another VM's disk or RAM file, by any path, is the
host-side half in tests/vmm/test_confinement.py.
"""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator
from typing import Any

import pytest

from agentenv.config import Settings
from agentenv.guest.envd.client import EnvdClient
from agentenv.node.host import Node, SandboxHandle

pytestmark = pytest.mark.vm


@pytest.fixture
async def node(settings: Settings, base_template: Any) -> AsyncIterator[Node]:
    async with Node(settings) as n:
        yield n


async def root_sh(sb: SandboxHandle, cmd: str, deadline_s: float = 120) -> tuple[int, str]:
    async with EnvdClient(sb.envd_url) as client:
        res = await client.run(cmd, user="root", timeout=deadline_s)
    return res[0], res[1]


def pattern(token: str) -> str:
    """A grep pattern for `token` that does not contain it: the search itself must not put
    the token into A's memory or disk."""
    return f"'{token[:8]}[{token[8]}]{token[9:]}'"


async def test_a_guest_finds_nothing_of_another_sandbox(node: Node) -> None:
    token = "ae-disk-" + secrets.token_hex(16)
    a = await node.create("base")
    b = await node.create("base")
    try:
        # B: the token on its disk, synced, and where on the device it lives.
        code, out = await root_sh(
            b,
            f"echo {token} > /root/secret && sync && "
            "filefrag -v -b4096 /root/secret | awk '$1==\"0:\" {print $4}' | tr -d .:",
        )
        assert code == 0 and out.strip().isdigit(), out
        block = int(out.strip())
        read_block = f"dd if=/dev/vda bs=4096 skip={block} count=1 iflag=direct 2>/dev/null"
        # The same block through B's own device: the token (so the probe can see it).
        code, out = await root_sh(b, f"{read_block} | grep -a -c {pattern(token)}")
        assert (code, out.strip()) == (0, "1"), out
        # What block devices A has: its own disk and the shared tools disk, nothing else.
        code, out = await root_sh(a, "ls /sys/block | grep -v -e '^loop' -e '^ram' | sort")
        assert (code, out.split()) == (0, ["vda", "vdb"]), out
        code, out = await root_sh(a, "cat /sys/block/vdb/ro")
        assert (code, out.strip()) == (0, "1")
        # A at that block of its disk, and anywhere on the tools disk: no token. `grep -c`
        # prints 0 (and exits 1) on no match; -z keeps grep's lines short on a raw device.
        code, out = await root_sh(a, f"{read_block} | grep -a -c {pattern(token)}")
        assert out.strip() == "0", (code, out)
        code, out = await root_sh(
            a, f"grep -a -z -c {pattern(token)} /dev/vdb 2>&1", deadline_s=300
        )
        assert out.strip() == "0", (code, out)
        # The shared tools disk cannot be written, even after root flips the kernel's flag:
        # QEMU opened it read-only.
        tools_sum = "dd if=/dev/vdb bs=65536 count=1 iflag=direct 2>/dev/null | sha256sum"
        code, before = await root_sh(b, tools_sum)
        assert code == 0
        code, out = await root_sh(
            a,
            "blockdev --setrw /dev/vdb 2>&1; "
            "dd if=/dev/zero of=/dev/vdb bs=4096 count=1 oflag=direct conv=notrunc 2>&1; "
            "echo rc=$?",
        )
        assert "rc=0" not in out, out
        # B's data is as it was.
        code, out = await root_sh(b, "cat /root/secret")
        assert (code, out.strip()) == (0, token)
        assert await root_sh(b, tools_sum) == (0, before)
    finally:
        await node.delete(a.id)
        await node.delete(b.id)
