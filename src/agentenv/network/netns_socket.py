"""Sockets that live in a slot's network namespace, used from this process's event loop.

A socket belongs to the namespace of the thread that created it, for its whole life. So one
dedicated thread enters the slot's namespace, creates (and binds) the socket, and goes back
to its own namespace before it does anything else; the event loop then uses the socket like
any other. The thread is this module's alone: the default executor's threads never change
namespace, and creating a socket waits on nothing another request holds.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import socket
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from agentenv.network.errors import NetworkError

CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)
_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="netns-socket")


def _setns(fd: int) -> None:
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def _create(
    netns_path: Path, kind: socket.SocketKind, bind: tuple[str, int] | None, reuse: bool
) -> socket.socket:
    own = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    try:
        target = os.open(netns_path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            _setns(target)
        finally:
            os.close(target)
        try:
            sock = socket.socket(socket.AF_INET, kind)
        finally:
            try:
                _setns(own)
            except OSError as exc:
                # This thread would create every later socket in the wrong namespace, and
                # so would any thread that took its place: stop the process, loudly.
                os.write(2, f"agentenv: cannot leave {netns_path}: {exc}\n".encode())
                os._exit(70)
    finally:
        os.close(own)
    try:
        if reuse:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if bind is not None:
            sock.bind(bind)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


async def socket_in(
    netns_path: Path,
    kind: socket.SocketKind = socket.SOCK_STREAM,
    *,
    bind: tuple[str, int] | None = None,
    reuse: bool = False,
) -> socket.socket:
    """A non-blocking IPv4 socket created inside the namespace at `netns_path`."""
    loop = asyncio.get_running_loop()
    try:
        return await loop.run_in_executor(_executor, _create, netns_path, kind, bind, reuse)
    except OSError as exc:
        where = f" on {bind[0]}:{bind[1]}" if bind else ""
        raise NetworkError(f"socket in {netns_path.name}{where}: {exc.strerror or exc}") from exc
