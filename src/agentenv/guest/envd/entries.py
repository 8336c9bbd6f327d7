"""E2B's EntryInfo for a path, and file metadata kept in extended attributes."""

from __future__ import annotations

import contextlib
import errno
import os
import stat

from protobuf.wkt.google.protobuf.timestamp_pb import Timestamp

from .errors import InvalidArgument, NotFound
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


# Upstream's limits (packages/shared/pkg/filesystem/xattr.go): the VFS caps an xattr name at
# 255 bytes, ext4 keeps all of an inode's xattrs in one 4 KiB block.
MAX_METADATA_KEY = 255 - len(XATTR_PREFIX)
MAX_METADATA_TOTAL = 4096


def validate_metadata(metadata: dict[str, str]) -> None:
    """Refuse what upstream's ValidateMetadata refuses (printable US-ASCII, sizes)."""
    total = 0
    for key, value in metadata.items():
        if not key:
            raise InvalidArgument("invalid metadata: metadata key must not be empty")
        if len(key) > MAX_METADATA_KEY:
            raise InvalidArgument(
                f"invalid metadata: metadata key {key!r} exceeds {MAX_METADATA_KEY} bytes"
            )
        for label, text in (("key", key), (f"value for key {key!r}", value)):
            for offset, char in enumerate(text):
                if not " " <= char <= "~":
                    raise InvalidArgument(
                        f"invalid metadata: metadata {label} contains non-printable-ASCII "
                        f"byte 0x{ord(char):02x} at offset {offset}"
                    )
        total += len(XATTR_PREFIX) + len(key) + len(value)
    if total > MAX_METADATA_TOTAL:
        raise InvalidArgument(
            f"invalid metadata: total metadata size {total} exceeds {MAX_METADATA_TOTAL} bytes"
        )


def replace_metadata(fd: int, metadata: dict[str, str]) -> None:
    """The open file's metadata becomes exactly `metadata`, as upstream's WriteMetadata does.

    Keys an earlier upload set and this one does not are removed: O_TRUNC keeps xattrs, and an
    overwritten file must not keep the metadata of the file it replaced.
    """
    for name in os.listxattr(fd):
        if name.startswith(XATTR_PREFIX) and name[len(XATTR_PREFIX) :] not in metadata:
            try:
                os.removexattr(fd, name)
            except OSError as exc:
                if exc.errno != errno.ENODATA:  # removed meanwhile
                    raise
    for key, value in metadata.items():
        os.setxattr(fd, XATTR_PREFIX + key, value.encode())


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
