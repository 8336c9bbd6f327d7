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


def printable(text: str) -> str:
    """`text` with bytes that were not UTF-8 (kept by os.fsdecode) shown as U+FFFD.

    File names are bytes; JSON and protobuf strings must be UTF-8. Upstream fails a whole
    listing (or watch) over one such name; we show the name, altered, and keep the rest.
    """
    return text.encode("utf-8", "surrogateescape").decode("utf-8", "replace")


def read_metadata(path: str) -> dict[str, str]:
    """The metadata of `path`, read through a symlink as upstream does (a link has no xattrs)."""
    found: dict[str, str] = {}
    try:
        names = os.listxattr(path)
    except OSError:
        return found
    for name in names:
        if name.startswith(XATTR_PREFIX):
            # A key or value that is not UTF-8 (set with setfattr) is left out, as upstream
            # does: it could not go out in the JSON or protobuf answer.
            with contextlib.suppress(OSError, UnicodeError):
                key = name[len(XATTR_PREFIX) :]
                key.encode()
                found[key] = os.getxattr(path, name).decode()
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


# Go's FileMode.String(), which upstream sends as `permissions` and the SDK has always shown:
# type and special-bit letters in Go's order, then rwx. `/tmp` is `dtrwxrwxrwx`, a setuid file
# `urwxr-xr-x`, a symlink `Lrwxrwxrwx`, /dev/null `Dcrw-rw-rw-`.
def _go_flags(mode: int) -> list[tuple[str, bool]]:
    kind = stat.S_IFMT(mode)
    return [
        ("d", kind == stat.S_IFDIR),
        ("L", kind == stat.S_IFLNK),
        ("D", kind in (stat.S_IFBLK, stat.S_IFCHR)),
        ("p", kind == stat.S_IFIFO),
        ("S", kind == stat.S_IFSOCK),
        ("u", bool(mode & stat.S_ISUID)),
        ("g", bool(mode & stat.S_ISGID)),
        ("c", kind == stat.S_IFCHR),
        ("t", bool(mode & stat.S_ISVTX)),
    ]


def permissions_string(mode: int) -> str:
    letters = "".join(letter for letter, present in _go_flags(mode) if present) or "-"
    bits = "".join(
        char if mode & (0o400 >> index) else "-" for index, char in enumerate("rwxrwxrwx")
    )
    return letters + bits


def file_type(mode: int) -> pb.FileType:
    if stat.S_ISDIR(mode):
        return pb.FileType.DIRECTORY
    if stat.S_ISLNK(mode):
        return pb.FileType.SYMLINK
    if stat.S_ISREG(mode):
        return pb.FileType.FILE
    return pb.FileType.UNSPECIFIED


def _link_target(path: str) -> tuple[str, os.stat_result | None]:
    """Where a symlink finally leads, and the stat of that, as upstream reports them.

    The target is fully resolved (every link on the way followed). A link that leads nowhere
    (dangling, a loop) names itself as its target and has no target stat.
    """
    try:
        return os.path.realpath(path, strict=True), os.stat(path)
    except OSError:
        return path, None


def entry_info(path: str, st: os.stat_result | None = None) -> pb.EntryInfo:
    """EntryInfo of `path` itself, `st` being its lstat when the caller has it.

    For a symlink, as upstream envd: `type` and `mode` describe the final target (type
    UNSPECIFIED and mode 0 when there is none, which makes the SDK drop it from listings),
    while size, owner, group, mtime and `permissions` (`Lrwxrwxrwx`) are the link's own.
    `is_symlink` marks the link: the SDK (2.63) then reports the type as symlink. `metadata`
    is the target's (xattrs are read through the link, as upstream does).
    """
    if st is None:
        try:
            st = os.lstat(path)
        except (FileNotFoundError, NotADirectoryError):
            raise NotFound(f"path not found: {path}") from None
    is_link = stat.S_ISLNK(st.st_mode)
    target: str | None = None
    kind = file_type(st.st_mode)
    # Go's FileMode.Perm(): the rwx bits only; setuid, setgid and sticky show in `permissions`.
    mode = st.st_mode & 0o777
    if is_link:
        target, target_st = _link_target(path)
        kind = file_type(target_st.st_mode) if target_st else pb.FileType.UNSPECIFIED
        mode = target_st.st_mode & 0o777 if target_st else 0
    seconds, nanos = divmod(st.st_mtime_ns, 1_000_000_000)
    return pb.EntryInfo(
        name=printable(os.path.basename(path) or path),
        type=kind,
        path=printable(path),
        size=st.st_size,
        mode=mode,
        permissions=permissions_string(st.st_mode),
        owner=user_name(st.st_uid),
        group=group_name(st.st_gid),
        modified_time=Timestamp(seconds=seconds, nanos=nanos),
        symlink_target=None if target is None else printable(target),
        metadata=read_metadata(path),
        is_symlink=is_link,
    )
