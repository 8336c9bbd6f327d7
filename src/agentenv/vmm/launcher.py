"""The VM launcher: one small single-threaded process per server that starts every QEMU.

The server (threads, an event loop) must not run Python between fork and exec, and spawning a
chain of programs per VM (sh, nsenter, unshare, mount, chroot, env) cost ~10 execs per start.
This process is started once (`vmm.launch.Launcher`) and talks over a socketpair. For each
launch it forks one child that, with system calls only, joins the VM's cgroup, enters its
network namespace (or a new one), gets a PID namespace of its own (as its PID 1), a mount
namespace whose root is a tmpfs holding only what the VM needs (`confine.Jail.plan`), drops to
the VM's uid/gid and execs QEMU. QEMU is the only program exec'd per VM start.

Messages are a 4-byte length and a JSON object, descriptors beside them (SCM_RIGHTS):

- server -> launcher: {"id", "plan"} with [stdout, stderr] descriptors;
- launcher -> server: {"id", "pid"} with a pidfd of the child (it has exec'd), or
  {"id", "error"}; and {"exit": pid, "status": code} when a child ends (it reaps them: the
  status is a returncode as `subprocess` gives it, -N for a signal).

When the server goes (end of file), the launcher stays until its last child has ended, so a
QEMU whose server was killed keeps a parent that reaps it; the next server adopts the QEMU and
runs a launcher of its own. Standard library only: it runs as a file (`python -I -S`).
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import json
import os
import select
import signal
import socket
import stat
import struct
import sys
import traceback
from typing import Any

CLONE_NEWNS = 0x00020000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_REMOUNT = 32
MS_BIND = 4096
MS_REC = 16384
MS_PRIVATE = 1 << 18
TUNSETIFF = 0x400454CA
TUNSETPERSIST = 0x400454CB
IFF_TAP = 0x0002
IFF_NO_PI = 0x1000
PR_SET_THP_DISABLE = 41
# A child that has not exec'd (or failed) in this time is killed and the launch fails.
SETUP_TIMEOUT_S = 20.0
MAX_MESSAGE = 1 << 20
FLAGS = {"ro": MS_RDONLY, "nosuid": MS_NOSUID, "nodev": MS_NODEV}

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p] * 3 + [ctypes.c_ulong, ctypes.c_char_p]


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(src: str | None, target: str, fstype: str | None, flags: int, data: str | None) -> None:
    def b(s: str | None) -> bytes | None:
        return None if s is None else os.fsencode(s)

    _check(_libc.mount(b(src), b(target), b(fstype), flags, b(data)), f"mount {target}")


def unshare(flags: int) -> None:
    _check(_libc.unshare(flags), "unshare")


def setns(fd: int, nstype: int) -> None:
    _check(_libc.setns(fd, nstype), "setns")


def _make_tap(name: str) -> None:
    """What `ip tuntap add dev NAME mode tap` does: a persistent tap in this namespace."""
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_CLOEXEC)
    try:
        ifr = struct.pack("16sH22x", name.encode(), IFF_TAP | IFF_NO_PI)
        fcntl.ioctl(fd, TUNSETIFF, ifr)
        fcntl.ioctl(fd, TUNSETPERSIST, 1)
    finally:
        os.close(fd)


def _build_root(jail: dict[str, Any]) -> None:
    """The VM's root on a tmpfs at jail["root"], in this (new, private) mount namespace."""
    root = jail["root"]
    _mount(None, "/", None, MS_REC | MS_PRIVATE, None)
    _mount("agentenv", root, "tmpfs", MS_NOSUID, "mode=0755,size=1m")
    for d in jail["dirs"]:
        os.makedirs(root + d, mode=0o755, exist_ok=True)
    for f in jail["files"]:
        os.close(os.open(root + f, os.O_CREAT | os.O_WRONLY | os.O_CLOEXEC, 0o644))
    for target, link in jail["links"]:
        os.symlink(target, root + link)
    for src, opts in jail["binds"]:
        dst = root + src
        _mount(src, dst, None, MS_BIND, None)
        flags = 0
        for opt in opts:
            flags |= FLAGS[opt]
        _mount(None, dst, None, MS_BIND | MS_REMOUNT | flags, None)
    for path, major, minor in jail["nodes"]:
        # Made, not bound: the host's node may be root's alone.
        os.mknod(root + path, stat.S_IFCHR | 0o666, os.makedev(major, minor))
        os.chmod(root + path, 0o666)


def _child(plan: dict[str, Any], out: int, err: int, report: int) -> None:
    """Runs in the forked child; never returns (exec or _exit)."""
    try:
        # What exec does not reset: ignored signals (Python ignores SIGPIPE and SIGXFSZ, the
        # launcher SIGINT) would stay ignored in QEMU.
        for sig in (signal.SIGPIPE, signal.SIGXFSZ, signal.SIGINT, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        signal.set_wakeup_fd(-1)
        os.setsid()
        if plan.get("no_thp"):
            # Kept across exec: QEMU's TCG translation buffer, madvised huge, is then backed
            # 4 KiB at a time as it fills instead of 2 MiB (~3 MB less per idle clone).
            one, zero = ctypes.c_ulong(1), ctypes.c_ulong(0)
            _check(_libc.prctl(PR_SET_THP_DISABLE, one, zero, zero, zero), "prctl")
        for procs in plan["cgroup_procs"]:
            with open(procs, "w") as f:
                f.write("0")
        if plan["netns"] is not None:
            fd = os.open(plan["netns"], os.O_RDONLY | os.O_CLOEXEC)
            setns(fd, CLONE_NEWNET)
            os.close(fd)
        elif plan["new_net"]:
            unshare(CLONE_NEWNET)
        null = os.open("/dev/null", os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(out, 1)
        os.dup2(err, 2)
        for fd in {null, out, err} - {0, 1, 2}:
            os.close(fd)
        jail = plan["jail"]
        if jail is not None:
            unshare(CLONE_NEWNS)
            _build_root(jail)
            if jail["tap"] is not None:
                _make_tap(jail["tap"])
            # Nothing in the root itself is QEMU's to change.
            _mount(None, jail["root"], None, MS_REMOUNT | MS_RDONLY | MS_NOSUID, None)
            os.chroot(jail["root"])
            os.chdir("/")
            # What QEMU creates itself (a RAM file, a serial log) is its uid's alone.
            os.umask(0o077)
            os.setgroups([jail["gid"]])
            os.setgid(jail["gid"])
            os.setuid(jail["uid"])
        env = dict(os.environ)
        env.update(plan["env"])
        os.execvpe(plan["argv"][0], plan["argv"], env)
    except BaseException as exc:
        try:
            detail = f"{type(exc).__name__}: {exc}"
            if not isinstance(exc, OSError):
                detail += "\n" + traceback.format_exc()
            os.write(report, detail.encode()[:4000])
        finally:
            os._exit(127)


def _launch(plan: dict[str, Any], fds: list[int], own_pidns: int) -> tuple[int, int]:
    """Fork the child for `plan`; (its pidfd, pid) once it has exec'd."""
    if len(fds) != 2:
        raise ValueError(f"a launch needs 2 descriptors, got {len(fds)}")
    r, w = os.pipe2(os.O_CLOEXEC)
    try:
        if plan["pid_ns"]:
            unshare(CLONE_NEWPID)
        try:
            pid = os.fork()
        except BaseException:
            if plan["pid_ns"]:
                setns(own_pidns, CLONE_NEWPID)
            raise
        if pid == 0:
            os.close(r)
            _child(plan, fds[0], fds[1], w)
        if plan["pid_ns"]:
            # Our own next children are born in our namespace again.
            setns(own_pidns, CLONE_NEWPID)
        os.close(w)
        w = -1
        pidfd = os.pidfd_open(pid)
        ready, _, _ = select.select([r], [], [], SETUP_TIMEOUT_S)
        if not ready:
            os.kill(pid, signal.SIGKILL)
            os.close(pidfd)
            raise TimeoutError(f"the child did not exec in {SETUP_TIMEOUT_S:.0f}s")
        detail = os.read(r, 4096)
        if detail:
            os.close(pidfd)
            raise RuntimeError(detail.decode(errors="replace"))
        return pidfd, pid
    finally:
        os.close(r)
        if w >= 0:
            os.close(w)


def send(sock: socket.socket, msg: dict[str, Any], fds: list[int] | None = None) -> None:
    data = json.dumps(msg).encode()
    data = struct.pack("<I", len(data)) + data
    anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack(f"{len(fds)}i", *fds))] if fds else []
    sock.sendmsg([data], anc)


def recv(sock: socket.socket) -> tuple[dict[str, Any], list[int]] | None:
    """One message, or None at end of file."""
    fds: list[int] = []
    head = b""
    while len(head) < 4:
        data, anc, _, _ = sock.recvmsg(4 - len(head), socket.CMSG_SPACE(16 * 4))
        for level, kind, payload in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds += list(
                    struct.unpack(f"{len(payload) // 4}i", payload[: len(payload) // 4 * 4])
                )
        if not data:
            return None
        head += data
    (size,) = struct.unpack("<I", head)
    if size > MAX_MESSAGE:
        raise ValueError(f"message of {size} bytes")
    body = b""
    while len(body) < size:
        chunk = sock.recv(size - len(body))
        if not chunk:
            return None
        body += chunk
    return json.loads(body), fds


def _reap(sock: socket.socket | None) -> bool:
    """Reap every ended child and tell the server; False once there are no children left."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return False
        if pid == 0:
            return True
        if sock is not None:
            with contextlib.suppress(OSError):
                send(sock, {"exit": pid, "status": os.waitstatus_to_exitcode(status)})


def serve(sock: socket.socket) -> None:
    own_pidns = os.open("/proc/self/ns/pid", os.O_RDONLY | os.O_CLOEXEC)
    wake_r, wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    server: socket.socket | None = sock
    while True:
        watched: list[int | socket.socket] = [wake_r] if server is None else [wake_r, server]
        ready, _, _ = select.select(watched, [], [], None if server is not None else 1.0)
        if wake_r in ready:
            with contextlib.suppress(BlockingIOError):
                os.read(wake_r, 4096)
        alive = _reap(server)
        if server is None:
            if not alive:
                return
            continue
        if server not in ready:
            continue
        try:
            got = recv(server)
        except (OSError, ValueError):
            got = None
        if got is None:
            server.close()
            server = None
            if not _reap(None):
                return
            continue
        msg, fds = got
        try:
            pidfd, pid = _launch(msg["plan"], fds, own_pidns)
        except Exception as exc:
            reply: dict[str, Any] = {"id": msg.get("id"), "error": str(exc)}
            out_fds: list[int] = []
        else:
            reply = {"id": msg.get("id"), "pid": pid}
            out_fds = [pidfd]
        finally:
            for fd in fds:
                os.close(fd)
        with contextlib.suppress(OSError):
            send(server, reply, out_fds)
        for fd in out_fds:
            os.close(fd)


def main() -> None:
    sock = socket.socket(fileno=int(sys.argv[1]))
    # Passed to us inheritable: no QEMU may hold a channel to the launcher (root).
    sock.set_inheritable(False)
    serve(sock)


if __name__ == "__main__":
    main()
