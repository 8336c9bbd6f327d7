"""A guest that turns against its slot, on real microVMs through the server and the official
SDK: as root it forges another identity (MAC, IP, ARP), floods the link and opens
connections without end. The slot's guard drops the forgeries (and counts them), the rate
limit holds both ways, the connection cap refuses what is beyond it, and a second sandbox on
the same node sees none of it.

The server runs with a low rate and cap (`AGENTENV_NET_RATE_MBIT`,
`AGENTENV_SLOT_MAX_CONNECTIONS`) so they can be measured in seconds under TCG. The far end
is the test's own "internet" namespace (`test_egress.internet`)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from test_egress import INET_IP, NETNS, PORT, internet

from agentenv.api.devserver import ServerProcess
from agentenv.config import Settings
from agentenv.network import nft, slot_for
from agentenv.network.slot import Slot, conntrack_entries, guard_counters
from agentenv.template.datadir import prepare_home

pytestmark = pytest.mark.vm

RATE_MBIT = 20
MAX_CONNECTIONS = 200
# Each way: at 20 Mbit/s about 6 s, against a bucket of one second.
TRANSFER_BYTES = 16 * 2**20
SINK_PORT, UDP_PORT, HOLD_PORT = 9000, 9001, 9002
# A sandbox's slot address, never another's: the identity a guest would steal.
FORGED_MAC = "02:ae:00:00:00:99"

# Runs in the test's internet: a TCP sink that answers with the byte count once the sender
# is done, a UDP sink that logs every datagram, and a port that takes any number of
# connections and closes each when its peer does.
SERVERS = r"""
import selectors, socket, sys, threading
ip, log, sink_port, udp_port, hold_port = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:6])
def listen(port, kind=socket.SOCK_STREAM):
    s = socket.socket(socket.AF_INET, kind)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((ip, port))
    if kind == socket.SOCK_STREAM:
        s.listen(1024)
    return s
def sink(conn):
    with conn:
        conn.settimeout(120)
        total = 0
        while chunk := conn.recv(1 << 16):
            total += len(chunk)
        conn.sendall(f"{total}\n".encode())
def sinks(s):
    while True:
        conn, _ = s.accept()
        threading.Thread(target=sink, args=(conn,), daemon=True).start()
def datagrams(s):
    with open(log, "a") as out:
        while True:
            data, peer = s.recvfrom(2048)
            out.write(f"{peer[0]} {data.decode(errors='replace')}\n")
            out.flush()
def holder(s):
    sel = selectors.DefaultSelector()
    sel.register(s, selectors.EVENT_READ)
    while True:
        for key, _ in sel.select():
            if key.fileobj is s:
                conn, _ = s.accept()
                conn.setblocking(False)
                sel.register(conn, selectors.EVENT_READ)
                continue
            try:
                data = key.fileobj.recv(4096)
            except OSError:
                data = b""
            if not data:
                sel.unregister(key.fileobj)
                key.fileobj.close()
threading.Thread(target=sinks, args=(listen(sink_port),), daemon=True).start()
threading.Thread(target=datagrams, args=(listen(udp_port, socket.SOCK_DGRAM),), daemon=True).start()
print("ready", flush=True)
holder(listen(hold_port))
"""

# In the guest, as root, detached from envd (whose own connection the forgery cuts): take
# other identities, send as them, then become itself again. Every step is bounded; the
# identity is restored whatever happens.
FORGE = r"""
import json, socket, struct, subprocess, sys, time
inet, udp_port, other_ip, forged_mac, out_path = sys.argv[1:6]
dev = "eth0"
def sh(cmd):
    return subprocess.run(cmd, shell=True, capture_output=True, text=True, timeout=20)
def udp(tag, count=5):
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for i in range(count):
            try:
                s.sendto(f"{tag} {i}".encode(), (inet, int(udp_port)))
            except OSError:
                pass
            time.sleep(0.05)
def raw(frames):
    with socket.socket(socket.AF_PACKET, socket.SOCK_RAW) as s:
        s.bind((dev, 0))
        for f in frames:
            s.send(f.ljust(60, b"\0"))
def mac(m):
    return bytes.fromhex(m.replace(":", ""))
def arp(src, sender_mac, sender_ip, target_ip, op=2):
    body = struct.pack("!HHBBH", 1, 0x0800, 6, 4, op) + mac(sender_mac)
    body += socket.inet_aton(sender_ip) + b"\xff" * 6 + socket.inet_aton(target_ip)
    return b"\xff" * 6 + mac(src) + b"\x08\x06" + body
own_mac = open(f"/sys/class/net/{dev}/address").read().strip()
sh("ping -c 1 -W 2 169.254.0.1")
neigh = sh("ip neigh show 169.254.0.1 dev eth0").stdout.split()
gw_mac = neigh[neigh.index("lladdr") + 1] if "lladdr" in neigh else "02:00:00:00:00:01"
report = {"own_mac": own_mac, "gateway_mac": gw_mac, "steps": []}
def pin_gateway():
    # A changed MAC or a removed address flushes the guest's neighbour table; pinned, the
    # guest sends under its new identity at once instead of only asking (ARP) for the way.
    sh(f"ip neigh replace 169.254.0.1 lladdr {gw_mac} dev {dev} nud permanent")
try:
    # Another MAC (made up; then the gateway's own) on the guest's interface.
    for m in (forged_mac, gw_mac):
        report["steps"].append(sh(f"ip link set {dev} address {m}").returncode)
        pin_gateway()
        udp(f"FORGED-MAC-{m}")
        sh("ping -c 2 -W 1 169.254.0.1")
    report["steps"].append(sh(f"ip link set {dev} address {own_mac}").returncode)
    # Another slot's address, and the gateway's, as the guest's own IP.
    for ip in (other_ip, "169.254.0.1"):
        sh(f"ip addr flush dev {dev}")
        report["steps"].append(sh(f"ip addr add {ip}/32 dev {dev}").returncode)
        sh(f"ip route replace default via 169.254.0.1 dev {dev} onlink")
        pin_gateway()
        udp(f"FORGED-IP-{ip}")
    # Raw frames under the guest's own MAC: ARP claiming the gateway's address or taking
    # the guest's address for another MAC, IPv4 from another slot's address, IPv6.
    udp_hdr = struct.pack("!HHHH", 4242, int(udp_port), 8 + 9, 0) + b"FORGED-RAW"[:9]
    ip_hdr = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(udp_hdr), 0, 0, 64, 17, 0,
                         socket.inet_aton(other_ip), socket.inet_aton(inet))
    raw([
        arp(own_mac, own_mac, "169.254.0.1", "169.254.0.1"),
        arp(own_mac, forged_mac, "169.254.0.2", "169.254.0.1"),
        arp(forged_mac, forged_mac, "169.254.0.2", "169.254.0.1", op=1),
        mac(gw_mac) + mac(own_mac) + b"\x08\x00" + ip_hdr + udp_hdr,
        b"\x33\x33\x00\x00\x00\x01" + mac(own_mac) + b"\x86\xdd" + b"\x60" + b"\0" * 39,
    ])
finally:
    sh(f"ip link set {dev} address {own_mac}")
    sh(f"ip neigh del 169.254.0.1 dev {dev}")
    sh(f"ip addr flush dev {dev}")
    sh(f"ip addr add 169.254.0.2/30 dev {dev}")
    sh(f"ip route replace default via 169.254.0.1 dev {dev}")
    sh(f"ip neigh flush dev {dev}")
    sh("ping -c 1 -W 2 169.254.0.1")
udp("LEGIT")
with open(out_path + ".tmp", "w") as out:
    json.dump(report, out)
import os
os.rename(out_path + ".tmp", out_path)
"""

# In the guest: send `n` bytes to the sink, wait for its count; bytes and seconds.
UPLOAD = r"""
import socket, sys, time
ip, port, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
chunk = b"u" * (1 << 16)
t = time.monotonic()
with socket.create_connection((ip, port), timeout=60) as s:
    left = n
    while left > 0:
        s.sendall(chunk[: min(left, len(chunk))])
        left -= min(left, len(chunk))
    s.shutdown(socket.SHUT_WR)
    got = int(s.makefile().readline())
print(got, round(time.monotonic() - t, 3))
"""

# In the guest: open `n` connections and hold them until `release` exists, then close
# them and open one more. Reports to `out` in two steps.
CONNECTIONS = r"""
import json, os, socket, sys, time
ip, port, n, out, release = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), *sys.argv[4:6]
held, outcomes = [], {}
t = time.monotonic()
for _ in range(n):
    try:
        held.append(socket.create_connection((ip, port), timeout=5))
        kind = "open"
    except OSError as exc:
        kind = type(exc).__name__
    outcomes[kind] = outcomes.get(kind, 0) + 1
def write(path, data):
    with open(path + ".tmp", "w") as f:
        json.dump(data, f)
    os.rename(path + ".tmp", path)
write(out + ".held", {"outcomes": outcomes, "seconds": round(time.monotonic() - t, 3)})
deadline = time.monotonic() + 120
while not os.path.exists(release) and time.monotonic() < deadline:
    time.sleep(0.2)
for s in held:
    s.close()
time.sleep(1)
try:
    socket.create_connection((ip, port), timeout=5).close()
    after = "open"
except OSError as exc:
    after = type(exc).__name__
write(out + ".done", {"after": after})
"""


@dataclass
class Net:
    udp_log: Path
    tmp: Path


@pytest.fixture(scope="module")
def net(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Net]:
    tmp = tmp_path_factory.mktemp("inet")
    (tmp / "blob").write_bytes(b"d" * TRANSFER_BYTES)
    udp_log = tmp / "udp.log"
    udp_log.touch()
    with internet(tmp):
        argv = ["ip", "netns", "exec", NETNS, sys.executable, "-c", SERVERS, INET_IP]
        ports = [str(p) for p in (SINK_PORT, UDP_PORT, HOLD_PORT)]
        proc = subprocess.Popen([*argv, str(udp_log), *ports], stdout=subprocess.PIPE)
        try:
            assert proc.stdout is not None and proc.stdout.readline() == b"ready\n"
            yield Net(udp_log=udp_log, tmp=tmp)
        finally:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def srv(net: Net, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    home = prepare_home(tmp_path_factory.mktemp("home"))
    env = {
        "AGENTENV_NET_RATE_MBIT": str(RATE_MBIT),
        "AGENTENV_SLOT_MAX_CONNECTIONS": str(MAX_CONNECTIONS),
    }
    with ServerProcess(home, env=env, ready_timeout_s=240) as server:
        yield server


@pytest.fixture(scope="module")
def sandboxes(srv: ServerProcess) -> Iterator[tuple[Any, Any]]:
    """Two sandboxes: the attacker and its neighbour."""
    from e2b import Sandbox

    opts: dict[str, Any] = {"api_key": srv.api_key, "api_url": srv.url, "sandbox_url": srv.url}
    made = []
    try:
        for _ in range(2):
            made.append(Sandbox.create(timeout=900, **opts))
        yield made[0], made[1]
    finally:
        for sbx in made:
            sbx.kill()


def slot_of(srv: ServerProcess, sandbox_id: str) -> Slot:
    """The slot a sandbox's VM runs in: the VM is named by the sandbox's id, and its record
    names its namespace."""
    path = srv.home / "run" / "vms" / f"{sandbox_id}.json"
    assert path.exists(), f"{sandbox_id} has no VM"
    rec = json.loads(path.read_text())
    index = int(rec["spec"]["netns"].removeprefix("ae-s"))
    return slot_for(Settings.from_env().network, index)


def counters(slot: Slot) -> dict[str, int]:
    return asyncio.run(guard_counters(slot))


def root(sbx: Any, cmd: str, timeout: float = 120) -> str:
    res = sbx.commands.run(cmd, user="root", timeout=timeout)
    return str(res.stdout)


def wait_file(sbx: Any, path: str, timeout_s: float = 120) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            out = root(sbx, f"cat {path} 2>/dev/null || true", timeout=20)
        except Exception:  # the guest forging its identity does not answer meanwhile
            out = ""
        if out.strip():
            return json.loads(out)
        time.sleep(1)
    log = root(sbx, "cat /tmp/*.log 2>/dev/null || true", timeout=20)
    raise AssertionError(f"{path} never appeared in the guest: {log[-2000:]}")


def udp_tags(net: Net) -> list[str]:
    return [line.split()[1] for line in net.udp_log.read_text().splitlines()]


def run_script(sbx: Any, name: str, script: str, *args: str) -> None:
    """Start `script` in the guest as root, detached (its outcome goes to files)."""
    sbx.files.write(f"/tmp/{name}.py", script)
    argv = " ".join(args)
    root(sbx, f"setsid python3 /tmp/{name}.py {argv} >/tmp/{name}.log 2>&1 </dev/null &")


def test_forged_identities_get_nothing_through(
    srv: ServerProcess, net: Net, sandboxes: Any
) -> None:
    attacker, neighbour = sandboxes
    a, b = slot_of(srv, attacker.sandbox_id), slot_of(srv, neighbour.sandbox_id)
    assert a.index != b.index
    before_a, before_b = counters(a), counters(b)
    run_script(
        attacker,
        "forge",
        FORGE,
        INET_IP,
        str(UDP_PORT),
        str(b.slot_ip),
        FORGED_MAC,
        "/tmp/forge.json",
    )
    report = wait_file(attacker, "/tmp/forge.json")
    assert report["steps"] == [0, 0, 0, 0, 0], report
    after_a = counters(a)
    grew = {k: after_a[k] - before_a[k] for k in after_a}
    # Each kind of forgery was caught: the changed MACs, the ARP claims, the foreign source
    # addresses, the IPv6 frame.
    assert grew["spoof_mac"] >= 8 and grew["spoof_ip"] >= 5, grew
    assert grew["spoof_arp"] >= 2 and grew["other_proto"] >= 1, grew
    # Nothing sent under a forged identity arrived; what the guest sent as itself did.
    tags = udp_tags(net)
    assert tags.count("LEGIT") == 5, tags
    assert not [t for t in tags if t.startswith("FORGED")], tags
    # The gateway still knows the guest by its own MAC.
    neigh = subprocess.run(
        ["ip", "-n", a.netns, "neigh", "show", "dev", a.tap],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert FORGED_MAC not in neigh, neigh
    # The attacker is itself again; the neighbour saw nothing and works.
    assert "from the internet" in root(
        attacker, f"curl -sS -m 20 http://{INET_IP}:{PORT}/hello.txt"
    )
    # (A guest's own IPv6 chatter, router solicitations and the like, is `other_proto`
    # on any slot.)
    forged = ("spoof_mac", "spoof_arp", "spoof_ip")
    assert {k: counters(b)[k] for k in forged} == {k: before_b[k] for k in forged}
    assert "from the internet" in root(
        neighbour, f"curl -sS -m 20 http://{INET_IP}:{PORT}/hello.txt"
    )


def test_rate_limit_holds_both_ways(srv: ServerProcess, net: Net, sandboxes: Any) -> None:
    _, sbx = sandboxes
    slot = slot_of(srv, sbx.sandbox_id)
    out = root(
        sbx,
        "curl -sS -o /dev/null -w '%{size_download} %{time_total}' "
        f"http://{INET_IP}:{PORT}/blob",
    )
    size, seconds = out.split()
    down = int(size) * 8 / float(seconds) / 1e6
    sbx.files.write("/tmp/upload.py", UPLOAD)
    dropped = counters(slot)["over_rate"]
    size, seconds = root(
        sbx, f"python3 /tmp/upload.py {INET_IP} {SINK_PORT} {TRANSFER_BYTES}"
    ).split()
    up = int(size) * 8 / float(seconds) / 1e6
    print(f"rate limit {RATE_MBIT} Mbit/s: down {down:.1f}, up {up:.1f} Mbit/s")
    assert int(size) == TRANSFER_BYTES
    assert 0.3 * RATE_MBIT <= down <= 1.3 * RATE_MBIT, down
    assert 0.3 * RATE_MBIT <= up <= 1.3 * RATE_MBIT, up
    # Upload is held by the policer on the tap's ingress.
    assert counters(slot)["over_rate"] > dropped


def test_connections_beyond_the_cap_are_refused(
    srv: ServerProcess, net: Net, sandboxes: Any
) -> None:
    sbx, _ = sandboxes
    slot = slot_of(srv, sbx.sandbox_id)
    asked = MAX_CONNECTIONS + 100
    run_script(
        sbx, "conns", CONNECTIONS, INET_IP, str(HOLD_PORT), str(asked), "/tmp/conns", "/tmp/release"
    )
    held = wait_file(sbx, "/tmp/conns.held")
    tracked = asyncio.run(conntrack_entries(slot))
    refused = asyncio.run(nft.counters(slot.netns, "inet", nft.TABLE))[nft.OVER_CAP]
    print(f"cap {MAX_CONNECTIONS}: {held}, {tracked} tracked, {refused} refused")
    outcomes = held["outcomes"]
    # Some of the cap goes to what else the guest has open (its own envd's are the host's
    # and do not count); the rest is refused at once.
    assert MAX_CONNECTIONS - 10 <= outcomes.get("open", 0) <= MAX_CONNECTIONS, held
    assert outcomes.get("ConnectionRefusedError", 0) >= asked - MAX_CONNECTIONS, held
    assert set(outcomes) <= {"open", "ConnectionRefusedError"}, held
    assert tracked <= MAX_CONNECTIONS + 32, tracked
    assert refused >= asked - MAX_CONNECTIONS
    root(sbx, "touch /tmp/release")
    done = wait_file(sbx, "/tmp/conns.done")
    assert done == {"after": "open"}, done
    assert "from the internet" in root(sbx, f"curl -sS -m 20 http://{INET_IP}:{PORT}/hello.txt")
