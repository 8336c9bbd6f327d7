"""PID 1 inside the sandbox: set the machine up, then run envd and reap orphans forever.

Started by the tools layer's /init after it pivoted into the sandbox rootfs, with the tools
layer at /.agentenv. Standard library only: it runs on the tools layer's Python, whatever the
rootfs holds. Settings come from the kernel command line (``agentenv.ip=169.254.0.2/30
agentenv.gw=169.254.0.1 agentenv.hostname=NAME agentenv.dns=ADDR[,ADDR]
agentenv.start_budget=SECONDS``).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path

from agentenv.ports import ENVD_PORT

TOOLS = Path("/.agentenv")
BUSYBOX = str(TOOLS / "bin" / "busybox")
PYTHON = str(TOOLS / "bin" / "python")
RUNTIME = TOOLS / "python"
ROOT_DEVICE = "vda"
# Smaller differences are rounding between qcow2 sizes and ext4 block groups.
GROW_THRESHOLD = 16 << 20
LOG_DIR = Path("/run/agentenv")
MARKER = "agentenv: envd started"
# A template's own services (the `docker` template's dockerd): executables run in name order
# before envd starts, so envd answering means they are up and a template snapshot holds them
# running. One budget for all of them; a hook past it is left running and envd starts anyway.
# The host sets the budget from its boot deadline (`agentenv.start_budget`, longer under
# TCG); this one is for a command line without it.
START_DIR = Path("/etc/agentenv/start.d")
START_BUDGET_S = 90.0
# One line per hook that did not end well ("name: outcome"), absent when all did: a template's
# build reads it before its capture, so a snapshot never holds a service its hook gave up on.
START_FAILED = LOG_DIR / "start-failed"

MS_NOSUID = 0x2
MS_NODEV = 0x4
MS_NOEXEC = 0x8
RB_AUTOBOOT = 0x01234567
RB_POWER_OFF = 0x4321FEDC
# Wall clock earlier than this means nothing set it (no RTC, or the RTC was never set).
CLOCK_SANE_AFTER = 1_700_000_000
RESTART_BACKOFF_MAX = 5.0
HEALTHY_RUN_S = 10.0
CONSOLE_WINDOW_S = 30.0

ENVD_ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "HOME": "/root",
    "LANG": "C.UTF-8",
    "TERM": "xterm",
}

_libc = ctypes.CDLL(None, use_errno=True)


def log(msg: str) -> None:
    with contextlib.suppress(OSError):
        os.write(1, f"agentenv: {msg}\n".encode())


def parse_cmdline(text: str) -> dict[str, str]:
    """``agentenv.KEY=VALUE`` pairs from a kernel command line, keyed by KEY."""
    out: dict[str, str] = {}
    for token in text.split():
        if token.startswith("agentenv.") and "=" in token:
            key, value = token[len("agentenv.") :].split("=", 1)
            out[key] = value
    return out


def start_budget(opts: Mapping[str, str]) -> float:
    """``agentenv.start_budget`` seconds, else `START_BUDGET_S` (also for a value that is
    not a positive number: PID 1 logs it and boots on)."""
    raw = opts.get("start_budget")
    if raw is None:
        return START_BUDGET_S
    try:
        value = float(raw)
    except ValueError:
        value = 0.0
    if not 0 < value < float("inf"):
        log(
            f"agentenv.start_budget={raw!r} is not a positive number of seconds: using "
            f"{START_BUDGET_S:.0f}"
        )
        return START_BUDGET_S
    return value


def mount(source: str, target: str, fstype: str, flags: int = 0, data: str = "") -> None:
    """mount(2); an already-mounted target is not an error."""
    Path(target).mkdir(parents=True, exist_ok=True)
    if (
        _libc.mount(
            source.encode(),
            target.encode(),
            fstype.encode(),
            flags,
            data.encode() if data else None,
        )
        != 0
    ):
        err = ctypes.get_errno()
        if err != errno.EBUSY:
            log(f"mount {fstype} on {target} failed: {os.strerror(err)}")


def is_mounted(target: str) -> bool:
    try:
        with open("/proc/self/mounts") as fh:
            return any(line.split()[1] == target for line in fh)
    except OSError:
        return False


def mount_filesystems() -> None:
    mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    if not is_mounted("/sys"):
        mount("sysfs", "/sys", "sysfs", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    if not is_mounted("/dev"):
        mount("devtmpfs", "/dev", "devtmpfs", MS_NOSUID, "mode=0755")
    tty_gid = _group_id("tty", 5)
    mount(
        "devpts",
        "/dev/pts",
        "devpts",
        MS_NOSUID | MS_NOEXEC,
        f"gid={tty_gid},mode=0620,ptmxmode=0666",
    )
    mount("tmpfs", "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777")
    mount("tmpfs", "/run", "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755")
    mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777")
    if not is_mounted("/sys/fs/cgroup"):
        mount(
            "cgroup2", "/sys/fs/cgroup", "cgroup2", MS_NOSUID | MS_NODEV | MS_NOEXEC, "nsdelegate"
        )
    _enable_cgroup_controllers()
    # devtmpfs has no /dev/fd & co.; shells need them for process substitution.
    for name, target in (
        ("fd", "/proc/self/fd"),
        ("stdin", "/proc/self/fd/0"),
        ("stdout", "/proc/self/fd/1"),
        ("stderr", "/proc/self/fd/2"),
        ("ptmx", "pts/ptmx"),
    ):
        link = Path("/dev") / name
        if not link.exists() and not link.is_symlink():
            with contextlib.suppress(OSError):
                link.symlink_to(target)


def _enable_cgroup_controllers() -> None:
    # Lets container runtimes inside the sandbox delegate cpu/memory/pids/io limits.
    root = Path("/sys/fs/cgroup")
    try:
        available = (root / "cgroup.controllers").read_text().split()
        (root / "cgroup.subtree_control").write_text(" ".join(f"+{c}" for c in available))
    except OSError:
        pass


def _group_id(name: str, default: int) -> int:
    try:
        for line in Path("/etc/group").read_text().splitlines():
            parts = line.split(":")
            if len(parts) > 2 and parts[0] == name:
                return int(parts[2])
    except (OSError, ValueError):
        pass
    return default


def busybox(*args: str) -> bool:
    proc = subprocess.run([BUSYBOX, *args], capture_output=True, check=False)
    if proc.returncode != 0:
        log(f"busybox {' '.join(args)}: {proc.stderr.decode(errors='replace').strip()}")
    return proc.returncode == 0


def setup_network(opts: Mapping[str, str]) -> None:
    busybox("ip", "link", "set", "lo", "up")
    if not Path("/sys/class/net/eth0").exists():
        log("no eth0: the sandbox has no network")
        return
    busybox("ip", "link", "set", "eth0", "up")
    if ip := opts.get("ip"):
        busybox("ip", "addr", "add", ip, "dev", "eth0")
    if gw := opts.get("gw"):
        busybox("ip", "route", "add", "default", "via", gw, "dev", "eth0")


def set_hostname(opts: Mapping[str, str]) -> None:
    name = opts.get("hostname")
    if not name:
        try:
            name = Path("/etc/hostname").read_text().strip()
        except OSError:
            name = ""
    name = name or "sandbox"
    try:
        socket.sethostname(name)
    except OSError as exc:
        log(f"sethostname {name}: {exc}")
        return
    # sudo and friends warn on every call when the hostname does not resolve.
    hosts = Path("/etc/hosts")
    try:
        text = hosts.read_text() if hosts.exists() else "127.0.0.1\tlocalhost\n"
        if not any(name in line.split()[1:] for line in text.splitlines() if line.strip()):
            hosts.write_text(text.rstrip("\n") + f"\n127.0.1.1\t{name}\n")
    except OSError:
        pass


def write_resolv_conf(opts: Mapping[str, str]) -> None:
    resolv = Path("/etc/resolv.conf")
    dns = opts.get("dns")
    if dns and not resolv.exists() and not resolv.is_symlink():
        try:
            resolv.write_text("".join(f"nameserver {d}\n" for d in dns.split(",") if d))
        except OSError as exc:
            log(f"resolv.conf: {exc}")


def ext4_size(device: str) -> int:
    """Filesystem size in bytes from the ext4 superblock."""
    with open(device, "rb") as fh:
        fh.seek(1024)
        sb = fh.read(1024)
    if sb[0x38:0x3A] != b"\x53\xef":
        return 0
    blocks_lo = int.from_bytes(sb[0x04:0x08], "little")
    blocks_hi = int.from_bytes(sb[0x150:0x154], "little")
    block_size = 1024 << int.from_bytes(sb[0x18:0x1C], "little")
    return ((blocks_hi << 32) | blocks_lo) * block_size


def grow_rootfs() -> None:
    """Grow the mounted rootfs to its disk when the sandbox got a disk bigger than the template."""
    try:
        disk = int(Path(f"/sys/class/block/{ROOT_DEVICE}/size").read_text()) * 512
        fs = ext4_size(f"/dev/{ROOT_DEVICE}")
    except (OSError, ValueError):
        return
    if fs == 0 or disk - fs < GROW_THRESHOLD:
        return
    loader = str(RUNTIME / "lib" / "ld-linux-x86-64.so.2")
    proc = subprocess.run(
        [
            loader,
            "--library-path",
            str(RUNTIME / "lib"),
            str(RUNTIME / "bin" / "resize2fs"),
            f"/dev/{ROOT_DEVICE}",
        ],
        capture_output=True,
        check=False,
    )
    if proc.returncode != 0:
        log(f"resize2fs: {proc.stderr.decode(errors='replace').strip()}")
    else:
        log(f"rootfs grown from {fs >> 20} to {disk >> 20} MiB")


def set_clock() -> None:
    # The host normally sets the time through envd; this only covers an unset clock.
    if time.time() < CLOCK_SANE_AFTER:
        busybox("hwclock", "-s", "-u")


def run_start_hooks(directory: Path = START_DIR, budget_s: float = START_BUDGET_S) -> None:
    """Run each executable in ``directory`` (name order) to completion, output in
    ``/run/agentenv/start-<name>.log``. A hook starts its daemon in the background and returns
    once it is ready; whatever it leaves running becomes PID 1's child and is reaped."""
    try:
        hooks = sorted(p for p in directory.iterdir() if p.is_file() and os.access(p, os.X_OK))
    except OSError:
        return
    deadline = time.monotonic() + budget_s
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    failed: list[str] = []
    for hook in hooks:
        left = deadline - time.monotonic()
        if left <= 0:
            log(f"start hook {hook.name}: skipped, the {budget_s:.0f}s budget is spent")
            failed.append(f"{hook.name}: skipped, the {budget_s:.0f}s budget was spent")
            continue
        started = time.monotonic()
        try:
            with open(LOG_DIR / f"start-{hook.name}.log", "ab") as out:
                proc = subprocess.run(
                    [str(hook)],
                    env=ENVD_ENV,
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    timeout=left,
                    start_new_session=True,
                    check=False,
                )
            outcome = "ok" if proc.returncode == 0 else f"exit {proc.returncode}"
        except subprocess.TimeoutExpired:
            outcome = "timed out"
        except OSError as exc:
            outcome = f"failed: {exc}"
        took = time.monotonic() - started
        log(f"start hook {hook.name}: {outcome} in {took:.1f}s")
        if outcome != "ok":
            failed.append(f"{hook.name}: {outcome} after {took:.0f}s")
    if failed:
        (LOG_DIR / START_FAILED.name).write_text("".join(f"{line}\n" for line in failed))


class Supervisor:
    """Runs envd, restarts it with backoff when it exits, and reaps every other child."""

    def __init__(self, argv: list[str]) -> None:
        self.argv = argv
        self.pid: int | None = None
        self.started_at = 0.0
        self.restart_at = 0.0
        self.backoff = 0.2
        self.log_path = LOG_DIR / "envd.log"

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        read_fd, write_fd = os.pipe()
        self.pid = os.posix_spawn(
            self.argv[0],
            self.argv,
            ENVD_ENV,
            file_actions=[
                (os.POSIX_SPAWN_OPEN, 0, "/dev/null", os.O_RDONLY, 0),
                (os.POSIX_SPAWN_DUP2, write_fd, 1),
                (os.POSIX_SPAWN_DUP2, write_fd, 2),
                (os.POSIX_SPAWN_CLOSE, read_fd),
            ],
            setsid=True,
            setsigmask=(),
            setsigdef=(
                signal.SIGTERM,
                signal.SIGINT,
                signal.SIGUSR1,
                signal.SIGUSR2,
                signal.SIGCHLD,
                signal.SIGPIPE,
            ),
        )
        os.close(write_fd)
        threading.Thread(target=self._copy_output, args=(read_fd,), daemon=True).start()
        self.started_at = time.monotonic()
        log(f"envd started (pid {self.pid})")

    def _copy_output(self, fd: int) -> None:
        # The serial console is slow under emulation: mirror envd's output there only while it
        # starts (where crashes happen); the log file gets all of it.
        console_until = time.monotonic() + CONSOLE_WINDOW_S
        with open(self.log_path, "ab", buffering=0) as logfile:
            while chunk := os.read(fd, 65536):
                logfile.write(chunk)
                if time.monotonic() < console_until:
                    with contextlib.suppress(OSError):
                        os.write(1, chunk)
        os.close(fd)

    def exited(self, status: int) -> None:
        ran = time.monotonic() - self.started_at
        log(f"envd exited ({_describe(status)}) after {ran:.1f}s")
        self.pid = None
        if ran > HEALTHY_RUN_S:
            self.backoff = 0.2
        self.restart_at = time.monotonic() + self.backoff
        self.backoff = min(self.backoff * 2, RESTART_BACKOFF_MAX)

    def run_forever(self) -> None:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})
        if self.pid is None:
            self.start()
        while True:
            self.reap()
            now = time.monotonic()
            if self.pid is None and now >= self.restart_at:
                self.start()
                continue
            timeout = self.restart_at - now if self.pid is None else 3600.0
            signal.sigtimedwait({signal.SIGCHLD}, max(timeout, 0.01))

    def reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            if pid == self.pid:
                self.exited(status)


def _describe(status: int) -> str:
    if os.WIFSIGNALED(status):
        return f"signal {os.WTERMSIG(status)}"
    return f"exit {os.waitstatus_to_exitcode(status)}"


def shutdown(reason: str = "shutdown") -> None:
    """Stop everything, flush the disks and power off (QEMU -no-reboot then exits)."""
    log(f"{reason}: stopping")
    for sig, wait in ((signal.SIGTERM, 2.0), (signal.SIGKILL, 0.5)):
        try:
            os.kill(-1, sig)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            try:
                if os.waitpid(-1, os.WNOHANG)[0] == 0:
                    time.sleep(0.05)
            except ChildProcessError:
                break
    # sync is what keeps the disk consistent; QEMU exits right after the power-off.
    os.sync()
    _libc.reboot(RB_POWER_OFF)
    # Without ACPI power-off, a reboot request also ends a -no-reboot VM.
    _libc.reboot(RB_AUTOBOOT)
    os._exit(1)


def _on_signal(signum: int, _frame: object) -> None:
    shutdown(signal.Signals(signum).name)


def main() -> None:
    if os.getpid() != 1:
        sys.exit("agentenv.guest.init must run as PID 1 inside a sandbox")
    os.chdir("/")
    os.umask(0o022)
    # busybox poweroff/halt/reboot signal init with USR2/USR1/TERM; ctrl-alt-del sends INT.
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, _on_signal)
    mount_filesystems()
    try:
        opts = parse_cmdline(Path("/proc/cmdline").read_text())
    except OSError:
        opts = {}
    set_clock()
    grow_rootfs()
    set_hostname(opts)
    setup_network(opts)
    write_resolv_conf(opts)
    run_start_hooks(budget_s=start_budget(opts))
    argv = [
        PYTHON,
        "-m",
        "agentenv.guest.envd",
        "--host",
        "0.0.0.0",
        "--port",
        str(ENVD_PORT),
        "--guest",
    ]
    supervisor = Supervisor(argv)
    while True:
        # PID 1 must never exit: the kernel would panic. Log and keep supervising.
        try:
            supervisor.run_forever()
        except Exception as exc:
            log(f"init loop error: {exc!r}")
            time.sleep(1)


if __name__ == "__main__":
    main()
