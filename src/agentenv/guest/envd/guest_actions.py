"""Things `/init` does to the guest itself; never run on the host (`--guest` enables them)."""

from __future__ import annotations

import ctypes
import fcntl
import os
import socket
import struct

from .errors import FailedPrecondition
from .libc import libc

CLOCK_REALTIME = 0
# _IOW('R', 0x03, int[2]) and _IO('R', 0x07) from <linux/random.h>
RNDADDENTROPY = 0x40085203
RNDRESEEDCRNG = 0x5207


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def set_clock(unix_ns: int) -> None:
    """Sets the wall clock: after a snapshot resume the guest's clock is where it was paused."""
    seconds, nanos = divmod(unix_ns, 1_000_000_000)
    ts = _Timespec(seconds, nanos)
    if libc().clock_settime(CLOCK_REALTIME, ctypes.byref(ts)) != 0:
        err = ctypes.get_errno()
        raise FailedPrecondition(f"clock_settime failed: {os.strerror(err)}")


def add_entropy(data: bytes) -> None:
    """Credits host randomness to the kernel pool: resumed snapshots share their RNG state."""
    if not data:
        return
    info = struct.pack("ii", len(data) * 8, len(data)) + data
    fd = os.open("/dev/urandom", os.O_WRONLY)
    try:
        fcntl.ioctl(fd, RNDADDENTROPY, info)
        # Added entropy reaches the output only at the next reseed (up to a minute away);
        # clones of one snapshot would read identical bytes until then.
        fcntl.ioctl(fd, RNDRESEEDCRNG)
    finally:
        os.close(fd)


def set_hostname(name: str) -> None:
    socket.sethostname(name)
