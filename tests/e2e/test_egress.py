"""Guest egress on a real microVM: the guest reaches a host beyond the node (the test's own
"internet", a namespace it creates), but not the node's addresses, and nothing routed through
the node can open a connection into the slot."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
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
from agentenv.network import Egress, nft
from agentenv.network.slot import host_lock
from agentenv.node.host import Node, SandboxHandle

pytestmark = pytest.mark.vm

NETNS = "aet-inet"
HOST_END, INET_END = "aet-i0", "aet-i1"
# TEST-NET-2: documentation space, routed nowhere; both ends live on this machine.
HOST_IP, INET_IP = "198.51.100.1", "198.51.100.2"
# A second host of the test's internet (on the namespace's loopback, routed via INET_IP).
OTHER_IP, OTHER_NET = "198.51.100.130", "198.51.100.128/25"
PORT = 8080


# The test's internet has names too: the session resolver (tests/resolver.py) answers them.
NAMES = {"inet.test": INET_IP, "www.inet.test": INET_IP, "other.test": OTHER_IP}
# Web servers of the test's internet: HTTP on 80 and HTTPS (self-signed) on 443.
WEB = """
import functools, http.server, ssl, sys, threading
ip, root, cert = sys.argv[1:4]
handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=root)
plain = http.server.ThreadingHTTPServer((ip, 80), handler)
tls = http.server.ThreadingHTTPServer((ip, 443), handler)
ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
ctx.load_cert_chain(cert)
tls.socket = ctx.wrap_socket(tls.socket, server_side=True)
threading.Thread(target=plain.serve_forever, daemon=True).start()
tls.serve_forever()
"""


def _certificate(tmp_path: Path) -> Path:
    key, crt = tmp_path / "web.key", tmp_path / "web.crt"
    subprocess.run(
        [
            *("openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1"),
            *("-subj", "/CN=inet.test", "-keyout", str(key), "-out", str(crt)),
        ],
        check=True,
        capture_output=True,
    )
    pem = tmp_path / "web.pem"
    pem.write_bytes(key.read_bytes() + crt.read_bytes())
    return pem


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


# One test "internet" on the host at a time: its namespace, veth and addresses have fixed
# names, and this module and test_isolation_probes both build it (on two workers at once,
# the second `ip netns add` failed).
INTERNET_LOCK = Path("/run/agentenv-test-internet.lock")
INTERNET_LOCK_WAIT_S = 900.0


@contextlib.contextmanager
def internet(tmp_path: Path) -> Iterator[Internet]:
    fd = os.open(INTERNET_LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        deadline = time.monotonic() + INTERNET_LOCK_WAIT_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                assert time.monotonic() < deadline, "another test held the test internet"
                time.sleep(0.2)
        with _internet(tmp_path) as inet:
            yield inet
    finally:
        os.close(fd)


@contextlib.contextmanager
def _internet(tmp_path: Path) -> Iterator[Internet]:
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
        pem = _certificate(tmp_path)
        for ip in (INET_IP, OTHER_IP):
            argv = ["ip", "netns", "exec", NETNS, sys.executable, "-c", WEB, ip, str(tmp_path)]
            procs.append(subprocess.Popen([*argv, str(pem)], stderr=subprocess.DEVNULL))
            _wait_listening(NETNS, f"http://{ip}/hello.txt")
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


def host_forwarding_setting() -> str:
    """IPv4 forwarding as the host had it before any agentenv slot. A slot of this node or of
    another process (the suite's other worker) may already have turned it on: the mark says so.
    Read under the host lock, which slots take to change either."""
    current = nft.IP_FORWARD.read_text().strip()
    return "0" if nft.FORWARD_MARK.exists() else current


async def test_guest_reaches_beyond_the_node_but_not_the_node(node: Node, tmp_path: Path) -> None:
    async with host_lock():
        forwarding_before = host_forwarding_setting()
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
    # With the last slot on the host gone, host forwarding is back to what it was; while
    # another process's slot lives on (the suite's other worker, another server), it stays
    # on, as that slot needs it.
    async with host_lock():
        others = [n for n in os.listdir("/sys/class/net") if n.startswith(nft.HOST_PREFIX)]
        forwarding = nft.IP_FORWARD.read_text().strip()
    assert forwarding == ("1" if others else forwarding_before), others


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

    from agentenv.api.devserver import ServerProcess
    from agentenv.template.datadir import prepare_home

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
        deny = Egress.of(deny_out=[f"{INET_IP}/32"])
        sb = await node.create("base", memory_mb=384, egress=deny)
        try:
            outcome, took = await _connect(sb, INET_IP)
            assert outcome == "ConnectionRefusedError" and took < 1.0, (outcome, took)
            assert (await _connect(sb, OTHER_IP))[0] == "open"
            # Internet off but one destination allowed: only that one.
            only = Egress.of(internet=False, allow_out=[OTHER_IP])
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

    from agentenv.api.devserver import ServerProcess
    from agentenv.template.datadir import prepare_home

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
                bad = api.put(f"/sandboxes/{sbx.sandbox_id}/network", json={"denyOut": ["::1"]})
                assert bad.status_code == 400 and "denyOut" in bad.json()["message"]
                bad = api.put(
                    f"/sandboxes/{sbx.sandbox_id}/network", json={"dnsServers": ["dns.example"]}
                )
                assert bad.status_code == 400 and "dnsServers" in bad.json()["message"]
                bad = api.put(f"/sandboxes/{sbx.sandbox_id}/network", json={"rules": {}})
                assert bad.status_code == 400 and "rules" in bad.json()["message"]
                # Omitted fields are cleared (E2B): an empty body opens everything.
                assert api.put(f"/sandboxes/{sbx.sandbox_id}/network", json={}).status_code == 204
                assert connect(OTHER_IP) == "open"
        finally:
            sbx.kill()


# curl's outcome and time in the guest: "200 0.012", or "000 <s> <exit code>" on failure.
CURL = "curl -sS -o /dev/null -m 10 -w '%{{http_code}} %{{time_total}}' {args} ; echo \" $?\""


async def _curl(sb: SandboxHandle, args: str) -> tuple[str, float]:
    _, out = await sh(sb, CURL.format(args=args))
    status, seconds, exit_code = out.split()[-3:]
    return (status if exit_code == "0" else f"curl exit {exit_code}"), float(seconds)


async def _resolves(sb: SandboxHandle, name: str) -> bool:
    code, _ = await sh(sb, f"getent hosts {name}")
    return code == 0


@pytest.fixture
def names(test_resolver: Any) -> Iterator[None]:
    for name, ip in NAMES.items():
        test_resolver.set(name, ip)
    yield
    for name in NAMES:
        test_resolver.records.pop(name, None)


async def test_allow_by_domain_lets_only_that_name_through(
    node: Node, tmp_path: Path, names: None
) -> None:
    with internet(tmp_path):
        only = Egress.of(deny_out=["0.0.0.0/0"], allow_out=["inet.test", "*.inet.test"])
        sb = await node.create("base", memory_mb=384, egress=only)
        try:
            assert await _resolves(sb, "inet.test")
            assert (await _curl(sb, "http://inet.test/hello.txt"))[0] == "200"
            assert (await _curl(sb, "-k https://inet.test/hello.txt"))[0] == "200"
            assert (await _curl(sb, "-k https://www.inet.test/hello.txt"))[0] == "200"
            for url in ("http://other.test/hello.txt", "-k https://other.test/hello.txt"):
                outcome, took = await _curl(sb, url)
                assert outcome.startswith("curl exit") and took < 1.0, (url, outcome, took)
            # By name, not by address: the allowed host's address under another name is
            # refused, and the allowed name is what counts.
            resolve = f"--resolve other.test:443:{INET_IP} -k https://other.test/hello.txt"
            assert (await _curl(sb, resolve))[0].startswith("curl exit")
            # Other ports: the addresses the allowed name resolved to, nothing else.
            assert (await _connect(sb, INET_IP))[0] == "open"
            outcome, took = await _connect(sb, OTHER_IP)
            assert outcome == "ConnectionRefusedError" and took < 1.0
            # Changed live: now only the other name.
            await node.update_egress(
                sb.id, Egress.of(deny_out=["0.0.0.0/0"], allow_out=["other.test"])
            )
            assert (await _curl(sb, "-k https://other.test/hello.txt"))[0] == "200"
            assert (await _curl(sb, "http://inet.test/hello.txt"))[0].startswith("curl exit")
            # Whatever is allowed, link-local (metadata) space stays out of reach, fast.
            await node.update_egress(sb.id, Egress.of(allow_out=["0.0.0.0/0"]))
            for where in ("http://169.254.169.254/", f"http://{HOST_IP}:{PORT}/hello.txt"):
                outcome, took = await _curl(sb, where)
                assert outcome.startswith("curl exit") and took < 1.0, (where, outcome, took)
            # No IPv6 path out at all.
            outcome, took = await _curl(sb, "-g http://[2001:db8::1]/")
            assert outcome.startswith("curl exit") and took < 1.0, (outcome, took)
        finally:
            await node.delete(sb.id)


async def test_deny_by_domain_blocks_exactly_those_names(
    node: Node, tmp_path: Path, names: None
) -> None:
    with internet(tmp_path):
        sb = await node.create("base", memory_mb=384, egress=Egress.of(deny_out=["other.test"]))
        try:
            assert not await _resolves(sb, "other.test")
            assert await _resolves(sb, "inet.test")
            assert (await _curl(sb, "http://inet.test/hello.txt"))[0] == "200"
            pinned = f"--resolve other.test:80:{OTHER_IP} http://other.test/hello.txt"
            outcome, took = await _curl(sb, pinned)
            assert outcome.startswith("curl exit") and took < 1.0, (outcome, took)
            # The address itself is not denied: only the name is.
            assert (await _curl(sb, f"http://{OTHER_IP}/hello.txt"))[0] == "200"
            # Internet off: no name resolves, nothing gets out.
            await node.update_egress(sb.id, Egress(internet=False))
            assert not await _resolves(sb, "inet.test")
            assert (await _curl(sb, f"http://{INET_IP}/hello.txt"))[0].startswith("curl exit")
        finally:
            await node.delete(sb.id)


def test_sdk_domains_and_update_network_survive_a_server_crash(tmp_path: Path, names: None) -> None:
    """Domain policy as a user of the official SDK writes it, changed live with
    `update_network`, and still enforced (DNS and the inspecting proxy back) after the
    server was SIGKILLed and a new one adopted the sandbox."""
    from e2b import ALL_TRAFFIC, Sandbox

    from agentenv.api.devserver import ServerProcess
    from agentenv.template.datadir import prepare_home

    home = prepare_home(tmp_path / "home")
    with internet(tmp_path):
        srv = ServerProcess(home, ready_timeout_s=240).start()
        try:
            opts: dict[str, Any] = {
                "api_key": srv.api_key,
                "api_url": srv.url,
                "sandbox_url": srv.url,
            }
            sbx = Sandbox.create(
                network={"allow_out": ["inet.test"], "deny_out": [ALL_TRAFFIC]}, **opts
            )

            def curl(url: str) -> str:
                out = sbx.commands.run(CURL.format(args=url)).stdout
                status, _, exit_code = out.split()[-3:]
                return status if exit_code == "0" else "failed"

            assert curl("-k https://inet.test/hello.txt") == "200"
            assert curl("-k https://other.test/hello.txt") == "failed"
            sbx.update_network({"allow_out": ["other.test"], "deny_out": [ALL_TRAFFIC]})
            assert curl("-k https://other.test/hello.txt") == "200"
            assert curl("http://inet.test/hello.txt") == "failed"
            info = Sandbox.get_info(sbx.sandbox_id, **opts)
            assert "other.test" in str(info.network), info.network

            srv.crash()
            srv = ServerProcess(home, port=srv.port, ready_timeout_s=240).start()
            sbx = Sandbox.connect(sbx.sandbox_id, **opts)
            assert curl("http://other.test/hello.txt") == "200"
            assert curl("-k https://inet.test/hello.txt") == "failed"
            sbx.kill()
        finally:
            srv.stop()
