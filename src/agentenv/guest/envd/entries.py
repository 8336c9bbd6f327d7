"""E2B's EntryInfo for a path, and file metadata kept in extended attributes."""

from __future__ import annotations

import contextlib
import os
import stat

from protobuf.wkt.google.protobuf.timestamp_pb import Timestamp

from .errors import NotFound
from .gen.filesystem import filesystem_pb as pb
from .users import group_name, user_name

# SDK file metadata (`X-Metadata-<key>` on upload) lives with the file itself, so it follows
# renames and vanishes with the file, like upstream envd does.
XATTR_PREFIX = "user.e2b."


def read_metadata(path: str) -> dict[str, str]:
    found: dict[str, str] = {}
    try:
        names = os.listxattr(path, follow_symlinks=False)
    except OSError:
        return found
    for name in names:
        if name.startswith(XATTR_PREFIX):
            with contextlib.suppress(OSError, UnicodeDecodeError):
                value = os.getxattr(path, name, follow_symlinks=False)
                found[name[len(XATTR_PREFIX) :]] = value.decode()
    return found


def write_metadata(path: str, metadata: dict[str, str]) -> None:
    for key, value in metadata.items():
        os.setxattr(path, XATTR_PREFIX + key, value.encode())


def _permissions(mode: int) -> str:
    # Go's FileMode.String(), which the SDK has always shown: `L` marks a symlink.
    text = stat.filemode(mode)
    return "L" + text[1:] if stat.S_ISLNK(mode) else text


def file_type(mode: int) -> pb.FileType:
    if stat.S_ISDIR(mode):
        return pb.FileType.DIRECTORY
    if stat.S_ISLNK(mode):
        return pb.FileType.SYMLINK
    if stat.S_ISREG(mode):
        return pb.FileType.FILE
    return pb.FileType.UNSPECIFIED


def entry_info(path: str, st: os.stat_result | None = None) -> pb.EntryInfo:
    """EntryInfo of `path` itself (a symlink is described, not followed)."""
    if st is None:
        try:
            st = os.lstat(path)
        except (FileNotFoundError, NotADirectoryError):
            raise NotFound(f"path not found: {path}") from None
    is_link = stat.S_ISLNK(st.st_mode)
    target: str | None = None
    if is_link:
        target = os.path.realpath(path)
    seconds, nanos = divmod(st.st_mtime_ns, 1_000_000_000)
    return pb.EntryInfo(
        name=os.path.basename(path) or path,
        type=file_type(st.st_mode),
        path=path,
        size=st.st_size,
        mode=stat.S_IMODE(st.st_mode),
        permissions=_permissions(st.st_mode),
        owner=user_name(st.st_uid),
        group=group_name(st.st_gid),
        modified_time=Timestamp(seconds=seconds, nanos=nanos),
        symlink_target=target,
        metadata=read_metadata(path) if not is_link else {},
        is_symlink=is_link,
    )
