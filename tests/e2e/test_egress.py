"""Guest egress on a real microVM: the guest reaches a host beyond the node (the test's own
"internet", a namespace it creates), but not the node's addresses, and nothing routed through
the node can open a connection into the slot."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from agentenv.config import Settings
from agentenv.guest.envd.client import EnvdClient
from agentenv.network import Egress, nft, parse_targets
from agentenv.orchestrator.node import Node, SandboxHandle

pytestmark = pytest.mark.vm

NETNS = "aet-inet"
HOST_END, INET_END = "aet-i0", "aet-i1"
# TEST-NET-2: documentation space, routed nowhere; both ends live on this machine.
HOST_IP, INET_IP = "198.51.100.1", "198.51.100.2"
# A second host of the test's internet (on the namespace's loopback, routed via INET_IP).
OTHER_IP, OTHER_NET = "198.51.100.130", "198.51.100.128/25"
PORT = 8080


@dataclass
class Internet:
    node_server: subprocess.Popen[bytes]
    inet_server: subprocess.Popen[bytes]


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


def _serve(argv_prefix: list[str], bind: str, root: Path) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(
        [*argv_prefix, sys.executable, "-m", "http.server", str(PORT), "--bind", bind],
        cwd=root,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    return proc


def _wait_listening(netns: str | None, url: str) -> None:
    prefix = ["ip", "netns", "exec", netns] if netns else []
    for _ in range(100):
        done = subprocess.run(
            [
                *prefix,
                "python3",
                "-c",
                f"import urllib.request as u; u.urlopen({url!r}, timeout=1)",
            ],
            capture_output=True,
            check=False,
        )
        if done.returncode == 0:
            return
        time.sleep(0.1)
    raise AssertionError(f"{url} never answered")


@contextlib.contextmanager
def internet(tmp_path: Path) -> Iterator[Internet]:
    (tmp_path / "hello.txt").write_text("from the internet\n")
    procs: list[subprocess.Popen[bytes]] = []
    _ip("netns", "add", NETNS)
    try:
        _ip("link", "add", HOST_END, "type", "veth", "peer", "name", INET_END, "netns", NETNS)
        _ip("addr", "add", f"{HOST_IP}/30", "dev", HOST_END)
        _ip("link", "set", HOST_END, "up")
        ns = ["-n", NETNS]
        _ip(*ns, "addr", "add", f"{INET_IP}/30", "dev", INET_END)
        _ip(*ns, "link", "set", INET_END, "up")
        _ip(*ns, "link", "set", "lo", "up")
        # The "internet" knows the way back to the whole slot range: it will try to reach in.
        _ip(
            *ns,
            "route",
            "add",
            Settings.from_env().network.slot_cidr.with_prefixlen,
            "via",
            HOST_IP,
        )
        _ip(*ns, "addr", "add", f"{OTHER_IP}/32", "dev", "lo")
        _ip("route", "add", OTHER_NET, "via", INET_IP)
        procs.append(_serve(["ip", "netns", "exec", NETNS], INET_IP, tmp_path))
        procs.append(_serve([], HOST_IP, tmp_path))
        procs.append(_serve(["ip", "netns", "exec", NETNS], OTHER_IP, tmp_path))
        _wait_listening(NETNS, f"http://{INET_IP}:{PORT}/hello.txt")
        _wait_listening(NETNS, f"http://{OTHER_IP}:{PORT}/hello.txt")
        _wait_listening(None, f"http://{HOST_IP}:{PORT}/hello.txt")
        yield Internet(node_server=procs[1], inet_server=procs[0])
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
        with contextlib.suppress(subprocess.CalledProcessError):
            _ip("route", "del", OTHER_NET)
        with contextlib.suppress(subprocess.CalledProcessError):
            _ip("link", "del", HOST_END)
        _ip("netns", "del", NETNS)


@pytest.fixture
async def node(settings: Settings, base_template: Any) -> AsyncIterator[Node]:
    async with Node(settings) as n:
        yield n


async def sh(sb: SandboxHandle, cmd: str) -> tuple[int, str]:
    async with EnvdClient(sb.envd_url) as client:
        res = await client.run(cmd, user="user", timeout=60)
    return res[0], res[1]


async def test_guest_reaches_beyond_the_node_but_not_the_node(node: Node, tmp_path: Path) -> None:
    forwarding_before = nft.IP_FORWARD.read_text().strip()
    with internet(tmp_path):
        sb = await node.create("base", memory_mb=384)
        try:
            code, out = await sh(sb, f"curl -sS -m 20 http://{INET_IP}:{PORT}/hello.txt")
            assert (code, out) == (0, "from the internet\n")

            # The node's own address on that link serves the same file, yet stays out of reach.
            code, _ = await sh(sb, f"curl -sS -m 5 http://{HOST_IP}:{PORT}/hello.txt")
            assert code != 0

            # From the internet side, the slot address is routed through the node but closed.
            probe = await asyncio.to_thread(
                subprocess.run,
                [
                    "ip",
                    "netns",
                    "exec",
                    NETNS,
                    "python3",
                    "-c",
                    f"import socket; socket.create_connection(({sb.address!r}, 49983), timeout=3)",
                ],
                capture_output=True,
                check=False,
            )
            assert probe.returncode != 0
            # The node itself still reaches the guest.
            async with httpx.AsyncClient(trust_env=False) as http:
                assert (await http.get(f"{sb.envd_url}/health")).status_code < 300
        finally:
            await node.delete(sb.id)
    await node.close()
    # With the last slot gone, host forwarding is back to what it was.
    assert nft.IP_FORWARD.read_text().strip() == forwarding_before


CONNECT_TIMED = (
    "python3 -c 'import socket,time\n"
    "t=time.monotonic()\n"
    "try:\n"
    '    socket.create_connection(("{ip}", {port}), timeout=10); print("open", end=" ")\n'
    "except OSError as e:\n"
    '    print(type(e).__name__, end=" ")\n'
    "print(round(time.monotonic()-t, 3))'"
)


async def _connect(sb: SandboxHandle, ip: str = INET_IP) -> tuple[str, float]:
    """How the guest's connect to a host of the test's internet ends, and how long it took
    (timed in the guest, so the envd round trip under TCG does not count)."""
    code, out = await sh(sb, CONNECT_TIMED.format(ip=ip, port=PORT))
    assert code == 0, out
    outcome, seconds = out.split()
    return outcome, float(seconds)


async def test_without_internet_connections_out_are_refused_fast_and_stay_refused(
    node: Node, tmp_path: Path
) -> None:
    with internet(tmp_path):
        open_ = await node.create("base", memory_mb=384)
        closed = await node.create("base", memory_mb=384, egress=Egress(internet=False))
        kids: list[SandboxHandle] = []
        try:
            assert (await _connect(open_))[0] == "open"
            outcome, took = await _connect(closed)
            assert outcome == "ConnectionRefusedError" and took < 1.0, (outcome, took)
            code, _ = await sh(closed, f"curl -sS -m 5 http://{INET_IP}:{PORT}/hello.txt")
            assert code != 0
            # The way in (the node, the proxy) still works.
            async with httpx.AsyncClient(trust_env=False) as http:
                assert (await http.get(f"{closed.envd_url}/health")).status_code < 300
            # Kept across pause/resume (another slot may be used) and given to fork children.
            await node.pause(closed.id)
            closed = await node.resume(closed.id)
            assert (await _connect(closed))[0] == "ConnectionRefusedError"
            kids = await node.fork(closed.id, 1)
            assert (await _connect(kids[0]))[0] == "ConnectionRefusedError"
            # A slot goes back to the pool open: the next sandbox on it has the internet.
            await node.delete(closed.id)
            again = await node.create("base", memory_mb=384)
            kids.append(again)
            assert (await _connect(again))[0] == "open"
        finally:
            for sb in [open_, closed, *kids]:
                with contextlib.suppress(Exception):
                    await node.delete(sb.id)


def test_sdk_allow_internet_access_false_is_enforced(tmp_path: Path) -> None:
    """Through the official SDK and the API, as a user asks for it."""
    from e2b import Sandbox

    from agentenv.api.devserver import ServerProcess, prepare_home

    home = prepare_home(tmp_path / "home")
    with internet(tmp_path), ServerProcess(home, ready_timeout_s=240) as srv:
        opts: dict[str, Any] = {"api_key": srv.api_key, "api_url": srv.url, "sandbox_url": srv.url}
        closed = Sandbox.create(allow_internet_access=False, **opts)
        try:
            out = closed.commands.run(CONNECT_TIMED.format(ip=INET_IP, port=PORT)).stdout
            assert out.split()[0] == "ConnectionRefusedError", out
            assert Sandbox.get_info(closed.sandbox_id, **opts).allow_internet_access is False
        finally:
            closed.kill()


async def test_allow_and_deny_by_cidr_block_exactly_and_change_live(
    node: Node, tmp_path: Path
) -> None:
    with internet(tmp_path):
        deny = Egress(deny_out=parse_targets("denyOut", [f"{INET_IP}/32"]))
        sb = await node.create("base", memory_mb=384, egress=deny)
        try:
            outcome, took = await _connect(sb, INET_IP)
            assert outcome == "ConnectionRefusedError" and took < 1.0, (outcome, took)
            assert (await _connect(sb, OTHER_IP))[0] == "open"
            # Internet off but one destination allowed: only that one.
            only = Egress(internet=False, allow_out=parse_targets("allowOut", [OTHER_IP]))
            await node.update_egress(sb.id, only)
            assert (await _connect(sb, OTHER_IP))[0] == "open"
            assert (await _connect(sb, INET_IP))[0] == "ConnectionRefusedError"
            # Cleared: everything again.
            await node.update_egress(sb.id, Egress())
            assert (await _connect(sb, INET_IP))[0] == "open"
            # A paused sandbox's change holds from its resume.
            await node.pause(sb.id)
            await node.update_egress(sb.id, deny)
            sb = await node.resume(sb.id)
            assert (await _connect(sb, INET_IP))[0] == "ConnectionRefusedError"
            assert (await _connect(sb, OTHER_IP))[0] == "open"
        finally:
            await node.delete(sb.id)


def test_network_policy_through_the_api_and_put_network(tmp_path: Path) -> None:
    from e2b import Sandbox

    from agentenv.api.devserver import ServerProcess, prepare_home

    home = prepare_home(tmp_path / "home")
    with internet(tmp_path), ServerProcess(home, ready_timeout_s=240) as srv:
        opts: dict[str, Any] = {"api_key": srv.api_key, "api_url": srv.url, "sandbox_url": srv.url}
        sbx = Sandbox.create(network={"deny_out": [f"{INET_IP}/32"]}, **opts)
        try:

            def connect(ip: str) -> str:
                out = sbx.commands.run(CONNECT_TIMED.format(ip=ip, port=PORT)).stdout
                return out.split()[0]

            assert connect(INET_IP) == "ConnectionRefusedError"
            assert connect(OTHER_IP) == "open"
            with httpx.Client(
                base_url=srv.url, headers={"X-API-Key": srv.api_key}, timeout=120
            ) as api:
                put = api.put(
                    f"/sandboxes/{sbx.sandbox_id}/network",
                    json={"allowInternetAccess": False, "allowOut": [INET_IP]},
                )
                assert put.status_code == 204, put.text
                assert connect(INET_IP) == "open"
                assert connect(OTHER_IP) == "ConnectionRefusedError"
                info = api.get(f"/sandboxes/{sbx.sandbox_id}").json()
                assert info["allowInternetAccess"] is False
                assert info["network"].get("allowOut") == [INET_IP]
                bad = api.put(f"/sandboxes/{sbx.sandbox_id}/network", json={"denyOut": ["x.com"]})
                assert bad.status_code == 400 and "denyOut" in bad.json()["message"]
                bad = api.put(f"/sandboxes/{sbx.sandbox_id}/network", json={"dnsServers": []})
                assert bad.status_code == 400 and "dnsServers" in bad.json()["message"]
                # Omitted fields are cleared (E2B): an empty body opens everything.
                assert api.put(f"/sandboxes/{sbx.sandbox_id}/network", json={}).status_code == 204
                assert connect(OTHER_IP) == "open"
        finally:
            sbx.kill()
