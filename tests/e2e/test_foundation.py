"""Acceptance for the foundation: real microVMs from the `base` template on this host.

At most two VMs run at once (the CI machine has two shared cores).
"""

from __future__ import annotations

import asyncio
import hashlib
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from agentenv.config import Settings
from agentenv.guest.envd.client import EnvdClient
from agentenv.node.errors import (
    CpuOutOfRange,
    DiskTooSmallForTemplate,
    MemoryOutOfRange,
    UnknownSandbox,
    UnknownTemplate,
)
from agentenv.node.host import Node, SandboxHandle
from agentenv.storage import LayerStore

pytestmark = pytest.mark.vm

BUSYBOX = "/.agentenv/bin/busybox"
MEM = 384


@pytest.fixture
async def node(settings: Settings, base_template: Any) -> AsyncIterator[Node]:
    async with Node(settings) as n:
        yield n


async def sh(sb: SandboxHandle, cmd: str) -> tuple[int, str, str]:
    async with EnvdClient(sb.envd_url) as client:
        res = await client.run(cmd, user="root", timeout=60)
    return res[0], res[1], res[2]


def sha256(path: Path) -> str:
    with path.open("rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


async def test_boot_reach_envd_and_see_the_guest_kernel(node: Node, guest_artifacts: Any) -> None:
    sb = await node.create("base", cpu=1, memory_mb=MEM, disk_size_mb=4096)
    assert sb.id.startswith("i") and len(sb.id) == 20 and sb.id.isalnum()
    assert sb.envd_url == f"http://{sb.address}:49983"
    assert sb.address.startswith("198.1")
    async with httpx.AsyncClient(trust_env=False) as http:
        assert (await http.get(f"{sb.envd_url}/health")).status_code in (200, 204)
    code, out, _ = await sh(sb, "uname -a")
    assert code == 0
    release = out.split()[2]
    assert release != os.uname().release
    expected = (Path(guest_artifacts.kernel).parent / "release").read_text().strip()
    assert release == expected
    assert sb.id in out  # the guest's hostname is the sandbox id
    # The disk was grown: the guest sees the requested size.
    code, out, _ = await sh(sb, "cat /sys/block/vda/size")
    assert code == 0 and int(out) * 512 == 4096 * 1024 * 1024
    # ... and guest init grew the filesystem to match.
    code, out, _ = await sh(sb, "df -Pm / | tail -1")
    assert code == 0 and int(out.split()[1]) > 3500, out
    assert node.list() == [sb]
    await node.delete(sb.id)
    assert not sb.upper.exists() and not sb.workdir.exists()
    with pytest.raises(UnknownSandbox):
        node.get(sb.id)


def _top(node: Node) -> str:
    from agentenv.template.catalog import TemplateCatalog

    return TemplateCatalog(node.settings).get("base").layers[-1]


async def test_writes_stay_in_their_sandbox(node: Node) -> None:
    top = _top(node)
    base_path = node.layers.path(top)
    a = await node.create("base", memory_mb=MEM)
    b = await node.create("base", memory_mb=MEM)
    assert a.upper != b.upper
    assert (await sh(a, "echo from-a > /root/marker && sync"))[0] == 0
    assert (await sh(a, "cat /root/marker"))[1].strip() == "from-a"
    code, _, _ = await sh(b, "test -e /root/marker")
    assert code != 0
    assert sorted(LayerStore(node.settings.layers_dir).holders(top)) == sorted(
        ["template:base", a.id, b.id]
    )
    await node.delete(b.id)
    assert not b.upper.exists()
    # Two VMs at most: the third sandbox starts after the second is gone.
    c = await node.create("base", memory_mb=MEM)
    code, _, _ = await sh(c, "test -e /root/marker")
    assert code != 0
    assert (await sh(c, "echo from-c > /root/other && sync"))[0] == 0
    assert (await sh(a, "test -e /root/other"))[0] != 0
    await node.delete(a.id)
    await node.delete(c.id)
    assert not a.upper.exists() and not c.upper.exists()
    # The base layer is untouched: its bytes still hash to its name.
    assert base_path.exists() and sha256(base_path) == top
    assert LayerStore(node.settings.layers_dir).holders(top) == ["template:base"]


async def test_network_slots_are_isolated(node: Node) -> None:
    # Something listening on every host address, to prove guests cannot reach it.
    hits: list[str] = []

    async def on_conn(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        hits.append(str(w.get_extra_info("peername")))
        w.close()

    server = await asyncio.start_server(on_conn, "0.0.0.0", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        a = await node.create("base", memory_mb=MEM)
        b = await node.create("base", memory_mb=MEM)
        assert a.address != b.address
        addr_cmd = f"{BUSYBOX} ip -4 -o addr show eth0; cat /sys/class/net/eth0/address"
        ca, oa, _ = await sh(a, addr_cmd)
        cb, ob, _ = await sh(b, addr_cmd)
        assert ca == cb == 0
        assert "169.254.0.2/30" in oa and oa.split()[-1] == ob.split()[-1]
        assert "169.254.0.2/30" in ob
        # Each slot address reaches its own guest.
        assert (await sh(a, "hostname"))[1].strip() == a.id
        assert (await sh(b, "hostname"))[1].strip() == b.id

        def get_health(host: str) -> str:
            # busybox's static wget crashes in name lookup; plain HTTP over nc needs none.
            req = "GET /health HTTP/1.0\\r\\n\\r\\n"
            return f"printf '{req}' | {BUSYBOX} nc -w 3 {host} 49983"

        # Positive control: the same probe gets an answer from the guest's own envd.
        code, out, _ = await sh(a, get_health("127.0.0.1"))
        assert code == 0 and out.startswith("HTTP/1.1 2"), out
        for target in (b.address, str(b.slot.host_ip), str(a.slot.host_ip), a.address):
            code, out, _ = await sh(a, get_health(target))
            assert code != 0 and "HTTP" not in out, f"guest a reached {target}:49983"
            code, _, _ = await sh(a, f"{BUSYBOX} nc -w 2 {target} {port} </dev/null")
            assert code != 0, f"guest a reached {target}:{port}"
        assert hits == []
        # From the host the slot addresses work.
        async with httpx.AsyncClient(trust_env=False) as http:
            for sb in (a, b):
                assert (await http.get(f"{sb.envd_url}/health")).is_success
    finally:
        server.close()
        await server.wait_closed()


async def test_bad_input_is_refused_and_leaves_nothing(node: Node) -> None:
    before = set(node.settings.sandboxes_dir.iterdir())
    with pytest.raises(UnknownTemplate, match="'nope' does not exist"):
        await node.create("nope")
    with pytest.raises(MemoryOutOfRange, match="below the guest minimum"):
        await node.create("base", memory_mb=node.settings.min_memory_mb - 1)
    with pytest.raises(CpuOutOfRange):
        await node.create("base", cpu=0)
    with pytest.raises(DiskTooSmallForTemplate, match="smaller than template"):
        await node.create("base", disk_size_mb=16)
    assert set(node.settings.sandboxes_dir.iterdir()) == before
    assert node.list() == []
    with pytest.raises(UnknownSandbox):
        await node.delete("i" + "0" * 19)
