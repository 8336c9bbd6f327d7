"""Confinement of a QEMU process (what Firecracker's jailer does for Firecracker).

Each confined QEMU:

- runs as a uid/gid of its own, without capabilities: `SLOT_UID_BASE + i` for the VM in
  network slot `i` (slots are host-wide, so two live VMs never share one), a uid derived
  from the VM's name in a range of its own for VMs without a slot (snapshot converters);
  no /etc/passwd entry is needed;
- in a mount namespace of its own whose root (`chroot`) is a private tmpfs holding only
  what this VM needs, each at its usual absolute path so QEMU's argv is unchanged: of the
  host's system files only QEMU's binary, the libraries it and its modules load, its
  module and firmware directories (`SystemView`), read-only; its workdir (read-write, bound as a
  directory so files made later - a seal's upper - appear in it), its kernel, initrd, tools
  image, the backing chain of every disk and a snapshot's memory file read-only, and the
  device nodes it needs (made in the tmpfs and owned by its uid, so it needs no group);
- under QEMU's seccomp filter (`-sandbox`, `SANDBOX`), which also denies exec, so RAM
  streams go through descriptors passed over QMP, not `exec:`.

The launcher (`vmm.launcher`, one process per server) builds that root with system calls in
the child it forks for the VM, as root, in the new mount namespace (`Jail.plan`), then drops
to the uid and execs QEMU: no other program runs. The tmpfs exists only in the VM's
namespace: it goes away with the process, and nothing is left on the host to clean up after
a crash.
"""

from __future__ import annotations

import functools
import mmap
import os
import shutil
import stat
import struct
import subprocess
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Where each VM's namespace mounts its root; an empty directory on the host.
JAIL_DIR = Path("/run/agentenv-jail")
# Well clear of login users and the usual subordinate-id ranges (100000 + 65536*n).
SLOT_UID_BASE = 2_000_000_000
# VMs without a network slot (converters): a name hash in this range.
SLOTLESS_UID_BASE = SLOT_UID_BASE + 1_000_000
SLOTLESS_UIDS = 1_000_000
NETNS_PREFIX = "ae-s"
# QEMU's own syscall filter: the default deny list plus everything it can live without.
SANDBOX = "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny"
# The commands confinement uses: `ldd` tells which libraries the root must hold (once per
# QEMU build; the launch itself spawns nothing but QEMU).
TOOLS = ("ldd",)
# Every QEMU gets these; /dev/net/tun and /dev/kvm only when it uses them.
BASE_DEVICES = ("/dev/null", "/dev/zero", "/dev/urandom", "/dev/random")
# Merged-/usr links, recreated in the root so library paths that go through them resolve.
USR_LINKS = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
# What runs in the root besides QEMU: nothing (the launcher sets the preload library's
# environment itself).
QEMU_HELPERS: tuple[str, ...] = ()


def vm_ids(name: str, netns: str | None) -> tuple[int, int]:
    """(uid, gid) of the VM `name` running in network namespace `netns`."""
    if netns is not None and netns.startswith(NETNS_PREFIX):
        index = netns[len(NETNS_PREFIX) :]
        if index.isdigit() and int(index) < SLOTLESS_UID_BASE - SLOT_UID_BASE:
            uid = SLOT_UID_BASE + int(index)
            return uid, uid
    uid = SLOTLESS_UID_BASE + zlib.crc32(name.encode()) % SLOTLESS_UIDS
    return uid, uid


@dataclass(frozen=True)
class SystemView:
    """The host system files a root holds, each bound read-only at its own path (with every
    directory on the way resolved, so no bind goes through a link)."""

    files: tuple[Path, ...]
    dirs: tuple[Path, ...]


def _normal(path: str) -> Path:
    """`path` with its directories resolved and its last component kept: a library's soname
    link stays the name the loader asks for, bound to the file it points at."""
    p = Path(path)
    return Path(os.path.realpath(p.parent)) / p.name


@functools.lru_cache(maxsize=64)
def _libraries(path: str, mtime_ns: int) -> tuple[str, ...]:
    """The shared objects `path` loads, as the dynamic loader resolves them on this host.
    ldd asks the loader to list them (it does not run the program)."""
    try:
        out = subprocess.run(
            ["ldd", path], capture_output=True, text=True, timeout=30, check=False
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ()
    found: list[str] = []
    for line in out.splitlines():
        # "libz.so.1 => /lib/x86_64-linux-gnu/libz.so.1 (0x...)", "/lib64/ld-linux... (0x...)"
        words = line.split()
        where = words[words.index("=>") + 1] if "=>" in words[:-1] else (words or [""])[0]
        if where.startswith("/"):
            found.append(where)
    return tuple(found)


def _qemu_dirs(binary: Path) -> list[Path]:
    """QEMU's firmware/data and module directories, by its install prefix (/usr/bin/qemu-*
    uses /usr/share/qemu and /usr/lib[/<multiarch>]/qemu)."""
    prefix = binary.resolve().parent.parent
    lib = prefix / "lib"
    modules = [lib / "qemu"]
    if lib.is_dir():
        modules += sorted(d / "qemu" for d in lib.iterdir() if d.is_dir() and "-linux-" in d.name)
    # Only a directory of modules: /usr/lib/qemu on Debian holds helpers (a setuid bridge
    # helper among them) that a QEMU which cannot exec has no use for.
    found = [m for m in modules if m.is_dir() and any(m.glob("*.so"))]
    data = prefix / "share" / "qemu"
    return [data, *found] if data.is_dir() else found


def system_view(programs: tuple[str, ...]) -> SystemView:
    """What of the host's system the root needs to run `programs` (names looked up on PATH):
    each program, every shared object it loads; for QEMU also its data and module
    directories, the libraries its accelerator modules load and files its data links point
    to. Worked out once per set of program files (a few ms of stats and listings that every
    VM start would otherwise repeat); a reinstalled program changes its mtime, and the key."""
    found = [shutil.which(name) for name in programs]
    key = tuple((f, os.stat(f).st_mtime_ns) for f in found if f is not None)
    return _system_view(key)


@functools.lru_cache(maxsize=16)
def _system_view(key: tuple[tuple[str, int], ...]) -> SystemView:
    files: dict[Path, None] = {}
    dirs: list[Path] = []
    objects: list[str] = []
    for found, _ in key:
        objects.append(found)
        files[_normal(found)] = None
        if Path(found).name.startswith("qemu-system-"):
            for d in _qemu_dirs(Path(found)):
                dirs.append(d)
                for entry in sorted(d.iterdir()):
                    if entry.suffix == ".so" and entry.name.startswith("accel-"):
                        # The accelerator is a module QEMU always loads; the others (display,
                        # audio, USB, remote storage) serve devices our VMs do not have, and
                        # their libraries (spice, gstreamer, nss) stay out of the root.
                        objects.append(str(entry))
                    elif entry.is_symlink() and entry.is_file():
                        target = Path(os.path.realpath(entry))
                        if not target.is_relative_to(d):
                            files[target] = None
    for obj in objects:
        for lib in _libraries(obj, os.stat(obj).st_mtime_ns):
            if os.path.exists(lib):
                files[_normal(lib)] = None
    inside = [f for f in files if not any(f.is_relative_to(d) for d in dirs)]
    return SystemView(files=tuple(inside), dirs=tuple(dirs))


@dataclass(frozen=True)
class Piece:
    """One thing confinement needs from the host, and whether it is there."""

    name: str
    ok: bool
    detail: str


@functools.lru_cache(maxsize=8)
def _links_seccomp(binary: str, mtime_ns: int) -> bool:
    # The dynamic section names the libraries; reading the file (not running it) keeps this
    # free of any QEMU process.
    with open(binary, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        return m.find(b"libseccomp.so") >= 0


def qemu_has_seccomp(qemu_binary: str) -> bool:
    path = shutil.which(qemu_binary)
    if path is None:
        return False
    try:
        return _links_seccomp(path, os.stat(path).st_mtime_ns)
    except (OSError, ValueError):
        return False


def pieces(qemu_binary: str) -> list[Piece]:
    """What confinement needs, each checked on this host (for `aenv doctor` and VM start)."""
    out = [Piece("root", os.geteuid() == 0, "the launch needs root to build the VM's root")]
    for tool in TOOLS:
        path = shutil.which(tool)
        out.append(Piece(f"command {tool}", path is not None, path or "missing"))
    out.append(
        Piece(
            "mount namespaces",
            Path("/proc/self/ns/mnt").exists(),
            "/proc/self/ns/mnt",
        )
    )
    try:
        status = Path("/proc/self/status").read_text()
    except OSError:
        status = ""
    pid_ns = "on" if pid_namespaces() else "off (the kernel has none; optional)"
    out.append(Piece(f"PID namespace: {pid_ns}", True, "/proc/self/ns/pid"))
    out.append(Piece("kernel seccomp", "\nSeccomp:" in status, "Seccomp: in /proc/self/status"))
    out.append(
        Piece(
            "QEMU seccomp (-sandbox)",
            qemu_has_seccomp(qemu_binary),
            f"{qemu_binary} linked with libseccomp",
        )
    )
    return out


def pid_namespaces() -> bool:
    """Whether QEMUs get a PID namespace (where the kernel has them; optional)."""
    return Path("/proc/self/ns/pid").exists()


def missing(qemu_binary: str) -> list[Piece]:
    return [p for p in pieces(qemu_binary) if not p.ok]


# QEMU binaries this process found everything confinement needs for.
_COMPLETE: set[str] = set()


def missing_once(qemu_binary: str) -> list[Piece]:
    """`missing`, looked at again only until it finds nothing (then once per process: the
    tools, namespaces and seccomp do not go away under a running server; every VM start
    asked, ~0.5 ms of PATH searches and /proc reads each). A gap is looked at on every call,
    so fixing the host needs no restart."""
    if qemu_binary in _COMPLETE:
        return []
    gaps = missing(qemu_binary)
    if not gaps:
        _COMPLETE.add(qemu_binary)
    return gaps


@dataclass
class Jail:
    """The root one VM gets. Paths are absolute host paths, bound at the same place."""

    uid: int
    gid: int
    # Directories bound read-write (the workdir, a QMP socket directory).
    rw_dirs: list[Path] = field(default_factory=list)
    # Files bound read-write (a writable disk or shared memory file outside the workdir).
    rw_files: list[Path] = field(default_factory=list)
    # Files bound read-only (kernel, initrd, tools image, backing layers, snapshot memory).
    ro_files: list[Path] = field(default_factory=list)
    # Device nodes made in the root, owned by the VM's uid.
    devices: list[str] = field(default_factory=lambda: list(BASE_DEVICES))
    # A tap the launch creates (as root) in a throwaway network namespace.
    make_tap: str | None = None
    # The programs that run in the root (QEMU): what of the host's system it holds follows
    # from them (`system_view`).
    programs: tuple[str, ...] = ()

    def add_ro(self, path: Path) -> None:
        if not self._covered(path) and path not in self.ro_files:
            self.ro_files.append(path)

    def add_rw(self, path: Path) -> None:
        if not self._covered(path) and path not in self.rw_files:
            self.rw_files.append(path)

    def _covered(self, path: Path) -> bool:
        return any(path.is_relative_to(d) for d in self.rw_dirs)

    def plan(self) -> dict[str, Any]:
        """The root as the launcher (`vmm.launcher`) builds it, with system calls, in the
        VM's new mount namespace: directories and empty files to bind onto, links, binds
        with their flags, device nodes; then the drop to this uid. JSON."""
        dirs: set[str] = set()
        files: list[str] = []
        binds: list[tuple[str, list[str]]] = []

        def bind(src: str, opts: list[str], is_file: bool) -> None:
            if is_file:
                files.append(src)
                dirs.add(str(Path(src).parent))
            else:
                dirs.add(src)
            binds.append((src, opts))

        system = _system_part(system_view(self.programs))
        dirs.update(system.dirs)
        files.extend(system.files)
        binds.extend((src, list(opts)) for src, opts in system.binds)
        links = list(system.links)
        for d in self.rw_dirs:
            bind(str(d), ["nosuid", "nodev"], False)
        for f in self.ro_files:
            bind(str(f), ["ro", "nosuid", "nodev"], True)
        for f in self.rw_files:
            bind(str(f), ["nosuid", "nodev"], True)
        nodes: list[tuple[str, int, int]] = []
        for dev in self.devices:
            st = os.stat(dev)
            if not stat.S_ISCHR(st.st_mode):
                continue
            if dev in BASE_DEVICES:
                bind(dev, ["nosuid"], True)
                continue
            # Made, not bound: the host's node may be root's alone. Only this VM's process
            # lives in this root, so 0666 is as narrow as owner-only.
            dirs.add(str(Path(dev).parent))
            nodes.append((dev, os.major(st.st_rdev), os.minor(st.st_rdev)))
        return {
            "root": str(JAIL_DIR),
            "dirs": sorted(dirs),
            "files": files,
            "links": links,
            "binds": binds,
            "nodes": nodes,
            "tap": self.make_tap,
            "uid": self.uid,
            "gid": self.gid,
        }


@dataclass(frozen=True)
class _SystemPart:
    dirs: frozenset[str]
    files: tuple[str, ...]
    binds: tuple[tuple[str, tuple[str, ...]], ...]
    links: tuple[tuple[str, str], ...]


@functools.lru_cache(maxsize=16)
def _system_part(view: SystemView) -> _SystemPart:
    """The part of every root's plan that holds the host's system (`view`): the same for
    every VM of one QEMU build, so worked out once (~60 binds' paths per VM start, #23)."""
    ro = ("ro", "nosuid", "nodev")
    dirs = {str(d) for d in view.dirs} | {str(f.parent) for f in view.files}
    binds = [(str(d), ro) for d in view.dirs] + [(str(f), ro) for f in view.files]
    # Merged-/usr links, recreated so library paths that go through them resolve. Where
    # /lib is a directory of its own, the files bound above are made at their paths in it.
    links = tuple((os.readlink(link), link) for link in USR_LINKS if Path(link).is_symlink())
    return _SystemPart(frozenset(dirs), tuple(str(f) for f in view.files), tuple(binds), links)


def prepare_host() -> None:
    """The empty directory every VM's namespace mounts its root on."""
    JAIL_DIR.mkdir(mode=0o755, exist_ok=True)


def own_dir(path: Path, gid: int) -> None:
    """A directory QEMU may create files in but not rename or remove the server's files from:
    root-owned, the VM's group, sticky."""
    os.chown(path, 0, gid)
    os.chmod(path, 0o1770)


def give(path: Path, uid: int, gid: int) -> None:
    """A file QEMU opens for writing: the VM's alone."""
    os.chown(path, uid, gid, follow_symlinks=True)
    os.chmod(path, 0o600)


def disown(path: Path) -> None:
    """A file a VM wrote that now becomes the server's, read-only to every VM that maps or
    reads it later (a captured RAM image, a converter's output)."""
    os.chown(path, 0, 0)
    os.chmod(path, 0o444)


_QCOW2_MAGIC = b"QFI\xfb"


def backing_chain(image: Path, limit: int = 256) -> list[Path]:
    """The backing files of a qcow2 image, nearest first, read from the headers (QEMU opens
    them by these names)."""
    out: list[Path] = []
    current = image
    for _ in range(limit):
        try:
            with open(current, "rb") as f:
                head = f.read(20)
                if len(head) < 20 or head[:4] != _QCOW2_MAGIC:
                    return out
                offset, size = struct.unpack(">QI", head[8:20])
                if offset == 0 or size == 0:
                    return out
                f.seek(offset)
                name = f.read(size).decode()
        except (OSError, UnicodeDecodeError):
            return out
        backing = Path(name)
        if not backing.is_absolute():
            backing = current.parent / backing
        out.append(backing)
        current = backing
    return out
