"""Network namespaces, and sockets that live in one, made without forking.

A socket belongs to the namespace of the thread that created it, for its whole life. So one
dedicated thread enters the slot's namespace, creates (and binds) the socket, and goes back
to its own namespace before it does anything else; the event loop then uses the socket like
any other. The thread is this module's alone: the default executor's threads never change
namespace, and creating a socket waits on nothing another request holds.

The same thread creates named namespaces (`unshare` of its own network namespace, bound to
`/run/netns/<name>`) and the netlink sockets pyroute2 works on (`AsyncIPRoute(fileno=...)`).
pyroute2 would fork a child running Python for each of those, and a fork of a process with
other threads running C code (gRPC's, under the etcd client of a node agent) can leave that
child crashed (SIGSEGV) or stuck; a thread needs no fork.
"""

from __future__ import annotations

import asyncio
import ctypes
import fcntl
import os
import socket
import struct
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

from agentenv.network.errors import NetworkError

CLONE_NEWNET = 0x40000000
MS_BIND = 4096
MS_REC = 16384
MS_SHARED = 1 << 20
MNT_DETACH = 2
NETNS_RUN_DIR = Path("/run/netns")
# getsockopt(SOL_SOCKET, SO_NETNS_COOKIE) (Linux 5.14): the 64-bit cookie of the socket's
# network namespace. Unlike the namespace's inode number, the kernel never hands a cookie out
# twice, so it tells a namespace from a later one under the same name.
SO_NETNS_COOKIE = 71
_libc = ctypes.CDLL(None, use_errno=True)
_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="netns-socket")
T = TypeVar("T")


def _setns(fd: int) -> None:
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def _libc_check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _share_run_dir() -> None:
    """`/run/netns` a shared mount, so a namespace bound there is seen in every mount
    namespace (what iproute2 does before its first `ip netns add`)."""
    NETNS_RUN_DIR.mkdir(mode=0o755, exist_ok=True)
    run = str(NETNS_RUN_DIR).encode()
    if _libc.mount(b"", run, b"none", MS_SHARED | MS_REC, None) == 0:
        return
    _libc_check(_libc.mount(run, run, b"none", MS_BIND | MS_REC, None), "bind /run/netns")
    _libc_check(_libc.mount(b"", run, b"none", MS_SHARED | MS_REC, None), "share /run/netns")


def _with_own_ns_back(work: Callable[[], T]) -> T:
    """Run `work` (which may move this thread to another namespace) and come back."""
    own = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    try:
        try:
            return work()
        finally:
            try:
                _setns(own)
            except OSError as exc:
                # This thread would make every later socket in the wrong namespace: stop.
                os.write(2, f"agentenv: cannot return to its own namespace: {exc}\n".encode())
                os._exit(70)
    finally:
        os.close(own)


def _cookie_here() -> int:
    """The cookie of the namespace this thread is in."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        cookie: int = struct.unpack("Q", sock.getsockopt(socket.SOL_SOCKET, SO_NETNS_COOKIE, 8))[0]
    return cookie


def _add_netns(name: str) -> int:
    path = NETNS_RUN_DIR / name
    _share_run_dir()
    # O_EXCL: the claim of the name is atomic against other processes.
    os.close(os.open(path, os.O_RDONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0))

    def make() -> int:
        _libc_check(_libc.unshare(CLONE_NEWNET), "unshare")
        _libc_check(
            _libc.mount(b"/proc/thread-self/ns/net", str(path).encode(), b"none", MS_BIND, None),
            f"bind {path}",
        )
        return _cookie_here()

    try:
        return _with_own_ns_back(make)
    except BaseException:
        path.unlink(missing_ok=True)
        raise


def _netns_cookie(name: str) -> int | None:
    def enter_and_read() -> int | None:
        try:
            target = os.open(NETNS_RUN_DIR / name, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        try:
            _setns(target)
        except OSError:
            # Not (yet) a namespace: another process's claim before its bind mount.
            return None
        finally:
            os.close(target)
        return _cookie_here()

    return _with_own_ns_back(enter_and_read)


def _remove_netns(name: str) -> None:
    path = NETNS_RUN_DIR / name
    _libc.umount2(str(path).encode(), MNT_DETACH)
    path.unlink(missing_ok=True)


async def add_netns(name: str) -> int:
    """Create the named network namespace (`ip netns add`); `FileExistsError` if taken.
    Its cookie (`netns_cookie`). The loop awaits the thread: `unshare` takes milliseconds,
    and the thread may be busy with another slot's work."""
    return await asyncio.get_running_loop().run_in_executor(_executor, _add_netns, name)


async def netns_cookie(name: str) -> int | None:
    """The cookie of the namespace now bound at `/run/netns/<name>`; None if there is none."""
    return await asyncio.get_running_loop().run_in_executor(_executor, _netns_cookie, name)


async def remove_netns(name: str) -> None:
    """Remove the named network namespace (`ip netns delete`); gone already is fine."""
    await asyncio.get_running_loop().run_in_executor(_executor, _remove_netns, name)


def _run_in(name: str, work: Callable[[], T]) -> T:
    def enter_and_work() -> T:
        target = os.open(NETNS_RUN_DIR / name, os.O_RDONLY | os.O_CLOEXEC)
        try:
            _setns(target)
        finally:
            os.close(target)
        return work()

    return _with_own_ns_back(enter_and_work)


async def run_in(name: str, work: Callable[[], T]) -> T:
    """Run the blocking `work` on this module's thread inside the named namespace (what
    `nsenter --net` did, without a process). `work` must not block for long: every namespace
    operation of the node waits behind it."""
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(_executor, _run_in, name, work)


# <linux/if_tun.h>
TUNSETIFF = 0x400454CA
TUNSETPERSIST = 0x400454CB
TUNSETOWNER = 0x400454CC
TUNSETGROUP = 0x400454CE
IFF_TAP = 0x0002
IFF_NO_PI = 0x1000


def _add_tap(name: str, tap: str, uid: int, gid: int) -> None:
    def make() -> None:
        target = os.open(NETNS_RUN_DIR / name, os.O_RDONLY | os.O_CLOEXEC)
        try:
            _setns(target)
        finally:
            os.close(target)
        fd = os.open("/dev/net/tun", os.O_RDWR | os.O_CLOEXEC)
        try:
            ifr = struct.pack("16sH22x", tap.encode(), IFF_TAP | IFF_NO_PI)
            fcntl.ioctl(fd, TUNSETIFF, ifr)
            fcntl.ioctl(fd, TUNSETOWNER, uid)
            fcntl.ioctl(fd, TUNSETGROUP, gid)
            fcntl.ioctl(fd, TUNSETPERSIST, 1)
        finally:
            os.close(fd)

    _with_own_ns_back(make)


async def add_tap(name: str, tap: str, uid: int, gid: int) -> None:
    """A persistent tap device `tap` in the named namespace, owned by `uid`/`gid` (only
    that user may attach it). Made with the tun driver's ioctls (taps are not made over
    rtnetlink), from this module's thread inside the namespace."""
    loop = asyncio.get_running_loop()
    try:
        await loop.run_in_executor(_executor, _add_tap, name, tap, uid, gid)
    except OSError as exc:
        raise NetworkError(f"tap {tap} in {name}: {exc.strerror or exc}") from exc


def _netlink_fd(name: str, proto: int) -> int:
    def make() -> int:
        target = os.open(NETNS_RUN_DIR / name, os.O_RDONLY | os.O_CLOEXEC)
        try:
            _setns(target)
        finally:
            os.close(target)
        sock = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC, proto)
        return sock.detach()

    return _with_own_ns_back(make)


async def netlink_fd(name: str, proto: int) -> int:
    """A netlink socket (protocol `proto`) in the named namespace, as a file descriptor for
    pyroute2 (`AsyncIPRoute(fileno=fd)`), which then owns it."""
    loop = asyncio.get_running_loop()
    try:
        return await loop.run_in_executor(_executor, _netlink_fd, name, proto)
    except OSError as exc:
        raise NetworkError(f"netlink socket in {name}: {exc.strerror or exc}") from exc


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
