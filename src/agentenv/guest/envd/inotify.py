"""Directory watching on inotify (through ctypes: envd may use only the stdlib in the guest).

Events are reported with fsnotify's vocabulary, which is what upstream envd and the SDK use:
create (also the new name of a rename), write, remove, rename (the old name) and chmod.
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from .errors import FailedPrecondition, InvalidArgument, NotFound
from .libc import libc

EventKind = Literal["create", "write", "remove", "rename", "chmod"]

IN_MODIFY = 0x00000002
IN_ATTRIB = 0x00000004
IN_MOVED_FROM = 0x00000040
IN_MOVED_TO = 0x00000080
IN_CREATE = 0x00000100
IN_DELETE = 0x00000200
IN_DELETE_SELF = 0x00000400
IN_MOVE_SELF = 0x00000800
IN_Q_OVERFLOW = 0x00004000
IN_IGNORED = 0x00008000
IN_ONLYDIR = 0x01000000
IN_ISDIR = 0x40000000
IN_NONBLOCK = os.O_NONBLOCK
IN_CLOEXEC = os.O_CLOEXEC

WATCH_MASK = (
    IN_MODIFY
    | IN_ATTRIB
    | IN_MOVED_FROM
    | IN_MOVED_TO
    | IN_CREATE
    | IN_DELETE
    | IN_DELETE_SELF
    | IN_MOVE_SELF
)
_EVENT = struct.Struct("iIII")

NETWORK_FILESYSTEMS = frozenset(
    {"nfs", "nfs4", "cifs", "smb3", "smbfs", "9p", "fuse.sshfs", "ceph", "glusterfs", "afs"}
)


@dataclass(frozen=True)
class FsEvent:
    name: str  # relative to the watched directory
    kind: EventKind


def filesystem_type(path: str) -> str:
    """The type of the filesystem holding `path`, from the longest matching mount point."""
    best, kind = "", ""
    with open("/proc/self/mounts") as mounts:
        for line in mounts:
            fields = line.split()
            if len(fields) < 3:
                continue
            point = fields[1].replace("\\040", " ")
            inside = path == point or path.startswith(point.rstrip("/") + "/")
            if inside and len(point) >= len(best):
                best, kind = point, fields[2]
    return kind


class DirWatcher:
    """Watches one directory (and optionally its subtree); calls `sink` with each event."""

    def __init__(
        self,
        path: str,
        *,
        recursive: bool,
        sink: Callable[[FsEvent], None],
        allow_network_mounts: bool = False,
    ) -> None:
        if not os.path.exists(path):
            raise NotFound(f"path not found: {path}")
        if not os.path.isdir(path):
            raise InvalidArgument(f"path {path} is not a directory")
        if not allow_network_mounts and filesystem_type(path) in NETWORK_FILESYSTEMS:
            # invalid_argument, as upstream: the SDK raises InvalidArgumentException for it.
            raise InvalidArgument(
                f"{path} is on a network filesystem; watching it needs allow_network_mounts"
            )
        self.root = path
        self.recursive = recursive
        self._sink = sink
        self._wd_dirs: dict[int, str] = {}
        fd = libc().inotify_init1(IN_NONBLOCK | IN_CLOEXEC)
        if fd < 0:
            err = ctypes.get_errno()
            raise FailedPrecondition(f"inotify_init1 failed: {os.strerror(err)}")
        self._fd = fd
        self._loop: asyncio.AbstractEventLoop | None = None
        try:
            self._add_tree("")
        except BaseException:
            os.close(fd)
            raise

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self._fd, self._on_readable)

    def close(self) -> None:
        if self._fd < 0:
            return
        if self._loop is not None:
            self._loop.remove_reader(self._fd)
        os.close(self._fd)
        self._fd = -1

    def _add(self, relative: str) -> None:
        full = os.path.join(self.root, relative) if relative else self.root
        wd = libc().inotify_add_watch(self._fd, os.fsencode(full), WATCH_MASK | IN_ONLYDIR)
        if wd < 0:
            err = ctypes.get_errno()
            if err in (errno.ENOENT, errno.ENOTDIR) and relative:
                return
            if err == errno.ENOSPC:
                raise FailedPrecondition(
                    "inotify watch limit reached (fs.inotify.max_user_watches)"
                )
            raise FailedPrecondition(f"cannot watch {full}: {os.strerror(err)}")
        self._wd_dirs[wd] = relative

    def _add_tree(self, relative: str) -> None:
        self._add(relative)
        if not self.recursive:
            return
        base = os.path.join(self.root, relative) if relative else self.root
        for dirpath, dirnames, _ in os.walk(base):
            for dirname in dirnames:
                full = os.path.join(dirpath, dirname)
                if not os.path.islink(full):
                    self._add(os.path.relpath(full, self.root))

    def _on_readable(self) -> None:
        try:
            buf = os.read(self._fd, 64 * 1024)
        except BlockingIOError:
            return
        offset = 0
        while offset + _EVENT.size <= len(buf):
            wd, mask, _cookie, length = _EVENT.unpack_from(buf, offset)
            raw = buf[offset + _EVENT.size : offset + _EVENT.size + length]
            offset += _EVENT.size + length
            self._handle(wd, mask, os.fsdecode(raw.rstrip(b"\0")))

    def _handle(self, wd: int, mask: int, name: str) -> None:
        if mask & IN_Q_OVERFLOW:
            return
        directory = self._wd_dirs.get(wd)
        if directory is None:
            return
        if mask & IN_IGNORED:
            del self._wd_dirs[wd]
            return
        relative = os.path.join(directory, name) if name else directory
        if mask & (IN_DELETE_SELF | IN_MOVE_SELF):
            # The directory's own removal is reported by its parent's watch, except for the root.
            if directory == "":
                kind: EventKind = "remove" if mask & IN_DELETE_SELF else "rename"
                self._sink(FsEvent(".", kind))
            return
        if mask & (IN_CREATE | IN_MOVED_TO):
            if self.recursive and mask & IN_ISDIR:
                self._add_tree(relative)
            self._sink(FsEvent(relative, "create"))
        elif mask & IN_MODIFY:
            self._sink(FsEvent(relative, "write"))
        elif mask & IN_DELETE:
            self._sink(FsEvent(relative, "remove"))
        elif mask & IN_MOVED_FROM:
            self._sink(FsEvent(relative, "rename"))
        elif mask & IN_ATTRIB:
            self._sink(FsEvent(relative, "chmod"))
