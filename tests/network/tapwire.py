"""The guest's end of a slot's tap, without a guest: a subprocess in the slot's namespace
attaches to the tap as QEMU would, writes raw Ethernet frames into it (they arrive as if the
guest sent them) and returns what the slot sent back within a short while."""

from __future__ import annotations

import ipaddress
import json
import struct
import subprocess
import sys

# Runs in the slot's namespace: attach to the tap (IFF_TAP | IFF_NO_PI), write the frames,
# then collect frames sent to the guest for `listen` seconds.
WIRE = r"""
import fcntl, json, os, select, struct, sys, time
req = json.load(sys.stdin)
fd = os.open("/dev/net/tun", os.O_RDWR)
fcntl.ioctl(fd, 0x400454CA, struct.pack("16sH", req["tap"].encode(), 0x0002 | 0x1000))
time.sleep(0.1)
start = time.monotonic()
for frame in req["frames"]:
    os.write(fd, bytes.fromhex(frame))
sent_s = time.monotonic() - start
got = []
deadline = time.monotonic() + req["listen"]
while (left := deadline - time.monotonic()) > 0:
    if select.select([fd], [], [], left)[0]:
        got.append(os.read(fd, 65536).hex())
print(json.dumps({"got": got, "sent_s": sent_s}))
"""

BROADCAST = "ff:ff:ff:ff:ff:ff"
ETH_IP, ETH_ARP, ETH_IPV6, ETH_VLAN = 0x0800, 0x0806, 0x86DD, 0x8100


def mac_bytes(mac: str) -> bytes:
    return bytes.fromhex(mac.replace(":", ""))


def ether(dst: str, src: str, ethertype: int, payload: bytes) -> bytes:
    frame = mac_bytes(dst) + mac_bytes(src) + struct.pack("!H", ethertype) + payload
    return frame.ljust(60, b"\0")


def arp_request(
    src_mac: str, sender_mac: str, sender_ip: str, target_ip: str, *, htype: int = 1
) -> bytes:
    body = struct.pack("!HHBBH", htype, ETH_IP, 6, 4, 1)
    body += mac_bytes(sender_mac) + ipaddress.IPv4Address(sender_ip).packed
    body += b"\0" * 6 + ipaddress.IPv4Address(target_ip).packed
    return ether(BROADCAST, src_mac, ETH_ARP, body)


def _checksum(data: bytes) -> int:
    if len(data) % 2:
        data += b"\0"
    total = sum(struct.unpack(f"!{len(data) // 2}H", data))
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return int(~total & 0xFFFF)


def udp_packet(
    dst_mac: str, src_mac: str, src_ip: str, dst_ip: str, sport: int, dport: int, size: int = 0
) -> bytes:
    """An Ethernet/IPv4/UDP frame with `size` bytes of payload (UDP checksum left 0)."""
    payload = b"x" * size
    udp = struct.pack("!HHHH", sport, dport, 8 + len(payload), 0) + payload
    header = struct.pack(
        "!BBHHHBBH4s4s",
        0x45,
        0,
        20 + len(udp),
        0,
        0x4000,
        64,
        17,
        0,
        ipaddress.IPv4Address(src_ip).packed,
        ipaddress.IPv4Address(dst_ip).packed,
    )
    header = header[:10] + struct.pack("!H", _checksum(header)) + header[12:]
    return ether(dst_mac, src_mac, ETH_IP, header + udp)


def wire(netns: str, frames: list[bytes], *, tap: str = "tap0", listen: float = 0.5) -> list[bytes]:
    """Write `frames` into the tap from the guest's side; the frames the slot sent back."""
    request = {"tap": tap, "frames": [f.hex() for f in frames], "listen": listen}
    done = subprocess.run(
        ["nsenter", f"--net=/run/netns/{netns}", "--", sys.executable, "-c", WIRE],
        input=json.dumps(request),
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    return [bytes.fromhex(f) for f in json.loads(done.stdout)["got"]]


def arp_replies(frames: list[bytes], sender_ip: str) -> list[bytes]:
    """ARP replies among `frames` from `sender_ip`."""
    packed = ipaddress.IPv4Address(sender_ip).packed
    return [
        f
        for f in frames
        if f[12:14] == struct.pack("!H", ETH_ARP) and f[20:22] == b"\0\x02" and f[28:32] == packed
    ]
