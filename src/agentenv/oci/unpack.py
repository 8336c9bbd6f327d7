"""Applying a layer archive (tar, tar+gzip, tar+zstd) onto a directory tree.

What an entry means follows the OCI image spec's changeset rules: ``.wh.<name>`` deletes
`name` from the layers below, ``.wh..wh..opq`` in a directory hides everything the layers
below put in it, and neither touches what this same layer adds (whatever the order of the
entries in the archive). Regular files, directories, symlinks, hardlinks, character and
block devices and FIFOs are created with their numeric owner, mode (after the owner, so
setuid bits stay), extended attributes (PAX ``SCHILY.xattr.*`` and libarchive's
``LIBARCHIVE.xattr.*``) and mtime; directory mtimes are set when the layer is done.

Nothing is written outside `root`: a member name with a ``..`` component is refused, and
symlinks met on the way to an entry (``/lib -> usr/lib`` is common) are resolved as if
`root` were ``/`` (absolute targets restart at `root`, ``..`` stops at it), so a link to
``/etc`` or ``../../..`` leads back into the tree. The last component is never followed:
an existing symlink at an entry's path is replaced, not written through.

The uncompressed stream is hashed while it is read, so the result names the layer's diffID
and the caller can check it against the image config. Compression is detected from the first
bytes (media types are sometimes wrong). gzip and zstd are decompressed by a ``zstd -dc``
child process (the zstd CLI reads both), so on a host with two cores the inflating runs beside
the Python that parses the tar and creates the entries; without the CLI, in-process.

Reading the blob (decompression, hashing) is `layer_stream`.
"""

from __future__ import annotations

import base64
import errno
import gzip
import io
import os
import shutil
import stat
import tarfile
import urllib.parse
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import zstandard

from agentenv.oci.errors import DigestMismatch, LayerError
from agentenv.oci.layer_stream import COPY_CHUNK, DecompressError, HashingReader, open_uncompressed

WHITEOUT = ".wh."
OPAQUE = ".wh..wh..opq"
MAX_SYMLINK_HOPS = 40


@dataclass(frozen=True)
class LayerStats:
    diff_id: str
    uncompressed_bytes: int
    entries: int
    file_bytes: int
    whiteouts: int = 0
    xattrs_skipped: int = 0


def _split(name: str, what: str) -> list[str]:
    parts = [p for p in name.replace("\\", "/").split("/") if p not in ("", ".")]
    if ".." in parts:
        raise LayerError(f"{what}: path {name!r} climbs out of the root (`..`)")
    return parts


class _Tree:
    """Path resolution inside `root` with chroot semantics (see the module docstring).

    `dirs` remembers paths (relative, ``/``-joined) seen to be real directories, so the
    components above each entry are not looked up again for every entry; `forget` drops a
    path and everything under it, and is called before anything is removed."""

    def __init__(self, root: Path) -> None:
        self.root = str(root.resolve())
        self.dirs: set[str] = set()

    def forget(self, parts: list[str]) -> None:
        rel = "/".join(parts)
        if rel in self.dirs:
            prefix = rel + "/"
            self.dirs = {d for d in self.dirs if d != rel and not d.startswith(prefix)}

    def real(self, parts: list[str]) -> str:
        return os.path.join(self.root, *parts) if parts else self.root

    def resolve(self, parts: list[str], what: str) -> list[str]:
        """Components of the entry `parts` with every symlink before the last resolved."""
        resolved: list[str] = []
        pending = list(parts)
        hops = 0
        while pending:
            comp = pending.pop(0)
            if comp in ("", "."):
                continue
            if comp == "..":
                if resolved:
                    resolved.pop()
                continue
            if not pending:
                resolved.append(comp)
                break
            candidate = [*resolved, comp]
            if "/".join(candidate) in self.dirs:
                resolved = candidate
                continue
            try:
                st = os.lstat(self.real(candidate))
            except FileNotFoundError:
                resolved = candidate
                continue
            if stat.S_ISLNK(st.st_mode):
                hops += 1
                if hops > MAX_SYMLINK_HOPS:
                    raise LayerError(f"{what}: too many symlinks under {'/'.join(parts)!r}")
                target = os.readlink(self.real(candidate))
                if target.startswith("/"):
                    resolved = []
                pending = target.split("/") + pending
            else:
                resolved = candidate
        return resolved

    def make_parents(self, parts: list[str], what: str) -> None:
        """Create missing directories above the entry (root-owned 0755, as Docker does)."""
        for i in range(1, len(parts)):
            rel = "/".join(parts[:i])
            if rel in self.dirs:
                continue
            path = self.real(parts[:i])
            try:
                st = os.lstat(path)
            except FileNotFoundError:
                os.mkdir(path, 0o755)
                self.dirs.add(rel)
                continue
            if not stat.S_ISDIR(st.st_mode):
                raise LayerError(f"{what}: {rel!r} is not a directory")
            self.dirs.add(rel)


def _remove(path: str) -> None:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(path)
    else:
        os.unlink(path)


def _xattrs(member: tarfile.TarInfo) -> dict[str, bytes]:
    out: dict[str, bytes] = {}
    for key, value in member.pax_headers.items():
        if key.startswith("SCHILY.xattr."):
            out[key[len("SCHILY.xattr.") :]] = value.encode("utf-8", "surrogateescape")
        elif key.startswith("LIBARCHIVE.xattr."):
            name = urllib.parse.unquote(key[len("LIBARCHIVE.xattr.") :])
            out[name] = base64.b64decode(value + "=" * (-len(value) % 4))
    return out


def _mtime_ns(member: tarfile.TarInfo) -> int:
    raw = member.pax_headers.get("mtime")
    try:
        return int(float(raw) * 1e9) if raw else int(member.mtime) * 1_000_000_000
    except ValueError:
        return int(member.mtime) * 1_000_000_000


class _Applier:
    def __init__(self, root: Path, what: str) -> None:
        self.tree = _Tree(root)
        self.what = what
        self.created: set[str] = set()
        self.ancestors: set[str] = set()
        self.opaque: list[list[str]] = []
        self.whiteouts = 0
        self.dir_times: list[tuple[str, int]] = []
        self.entries = 0
        self.file_bytes = 0
        self.xattrs_skipped = 0

    def _note_created(self, parts: list[str]) -> None:
        self.created.add("/".join(parts))
        for i in range(1, len(parts)):
            self.ancestors.add("/".join(parts[:i]))

    def entry(self, tar: tarfile.TarFile, member: tarfile.TarInfo) -> None:
        self.entries += 1
        raw_parts = _split(member.name, self.what)
        if not raw_parts:
            if member.isdir():  # "./" itself: the root's metadata
                self._metadata(self.tree.root, member, is_link=False)
            return
        base = raw_parts[-1]
        if base.startswith(WHITEOUT):
            parent = self.tree.resolve([*raw_parts[:-1], "x"], self.what)[:-1]
            if base == OPAQUE:
                # Only known once the whole layer is in: what this layer adds stays.
                self.opaque.append(parent)
                return
            # Deleted at once (as containerd does), unless this layer made it.
            victim = [*parent, base[len(WHITEOUT) :]]
            rel = "/".join(victim)
            self.whiteouts += 1
            if rel not in self.created and rel not in self.ancestors:
                self.tree.forget(victim)
                _remove(self.tree.real(victim))
            return
        parts = self.tree.resolve(raw_parts, self.what)
        if not parts:
            return
        self.tree.make_parents(parts, self.what)
        path = self.tree.real(parts)
        try:
            existing: os.stat_result | None = os.lstat(path)
        except FileNotFoundError:
            existing = None
        if member.isdir():
            if existing is not None and not stat.S_ISDIR(existing.st_mode):
                os.unlink(path)
                existing = None
            if existing is None:
                os.mkdir(path, 0o700)
            self.tree.dirs.add("/".join(parts))
        else:
            if existing is not None:
                self.tree.forget(parts)
                _remove(path)
            self._create(tar, member, path)
        self._note_created(parts)
        if member.islnk():
            return  # a hardlink shares its target's inode and metadata
        self._metadata(path, member, is_link=member.issym())
        if member.isdir():
            self.dir_times.append((path, _mtime_ns(member)))

    def _create(self, tar: tarfile.TarFile, member: tarfile.TarInfo, path: str) -> None:
        if member.isreg():
            src = tar.extractfile(member)
            assert src is not None
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "wb") as out:
                shutil.copyfileobj(src, out, COPY_CHUNK)
            self.file_bytes += member.size
        elif member.issym():
            os.symlink(member.linkname, path)
        elif member.islnk():
            target_parts = self.tree.resolve(_split(member.linkname, self.what), self.what)
            target = self.tree.real(target_parts)
            if not target_parts or not os.path.lexists(target):
                raise LayerError(
                    f"{self.what}: hardlink {member.name!r} to missing {member.linkname!r}"
                )
            os.link(target, path, follow_symlinks=False)
        elif member.ischr() or member.isblk():
            kind = stat.S_IFCHR if member.ischr() else stat.S_IFBLK
            os.mknod(path, kind | 0o600, os.makedev(member.devmajor, member.devminor))
        elif member.isfifo():
            os.mkfifo(path, 0o600)
        else:
            raise LayerError(
                f"{self.what}: {member.name!r} has unsupported tar type {member.type!r}"
            )

    def _metadata(self, path: str, member: tarfile.TarInfo, *, is_link: bool) -> None:
        os.chown(path, member.uid, member.gid, follow_symlinks=False)
        if not is_link:
            os.chmod(path, member.mode & 0o7777)
        for name, value in _xattrs(member).items():
            try:
                os.setxattr(path, name, value, follow_symlinks=False)
            except OSError as exc:
                # A namespace the target filesystem does not support (or user.* on a link).
                if exc.errno not in (errno.ENOTSUP, errno.EPERM):
                    raise
                self.xattrs_skipped += 1
        if not member.isdir():
            t = _mtime_ns(member)
            os.utime(path, ns=(t, t), follow_symlinks=False)

    def finish(self) -> int:
        for parts in self.opaque:
            self._prune(parts)
        for path, t in sorted(self.dir_times, key=lambda x: -x[0].count("/")):
            if os.path.isdir(path) and not os.path.islink(path):
                os.utime(path, ns=(t, t), follow_symlinks=False)
        return self.whiteouts + len(self.opaque)

    def _prune(self, parts: list[str]) -> None:
        """Remove what lower layers left under `parts`, keeping this layer's entries."""
        path = self.tree.real(parts)
        if not os.path.isdir(path) or os.path.islink(path):
            return
        for child in os.listdir(path):
            cparts = [*parts, child]
            rel = "/".join(cparts)
            if rel in self.created or rel in self.ancestors:
                cpath = self.tree.real(cparts)
                if os.path.isdir(cpath) and not os.path.islink(cpath):
                    self._prune(cparts)
            else:
                self.tree.forget(cparts)
                _remove(self.tree.real(cparts))


# Decompression failures, whichever decompressor saw them; and those plus a bad tar.
_BAD_STREAM: tuple[type[Exception], ...] = (
    EOFError, zstandard.ZstdError, gzip.BadGzipFile, zlib.error, DecompressError,
)  # fmt: skip
_BAD_ARCHIVE: tuple[type[Exception], ...] = (tarfile.TarError, *_BAD_STREAM)


def _members(stream: BinaryIO, what: str) -> Iterator[tuple[tarfile.TarFile, tarfile.TarInfo]]:
    try:
        with tarfile.open(fileobj=stream, mode="r|") as tar:
            for member in tar:
                yield tar, member
    except _BAD_ARCHIVE as exc:
        raise LayerError(f"{what}: not a valid layer archive ({exc})") from None


def apply_layer(
    root: Path,
    blob: Path,
    *,
    diff_id: str | None = None,
    what: str = "layer",
    progress: Callable[[int], None] | None = None,
) -> LayerStats:
    """Apply `blob` onto the tree at `root`; DigestMismatch if its diffID is not `diff_id`.
    `progress` is called with the uncompressed bytes read so far, every few MB and at the end.

    The diffID is only known once the whole archive has been read, so a mismatching layer
    has been applied by then: callers apply into a scratch tree or image they can discard."""
    with open_uncompressed(blob) as raw:
        hashing = HashingReader(raw, progress=progress)
        try:
            applier = _Applier(root, what)
            stream = io.BufferedReader(hashing, COPY_CHUNK)
            for tar, member in _members(stream, what):
                applier.entry(tar, member)
            # What the buffered reader holds was hashed already; the rest is padding.
            try:
                actual = hashing.finish()
            except _BAD_STREAM as exc:
                raise LayerError(f"{what}: truncated layer archive ({exc})") from None
        finally:
            hashing.close()
    whiteouts = applier.finish()
    if diff_id is not None and actual != diff_id:
        raise DigestMismatch(
            f"{what}: uncompressed content hashes to {actual}, the image config says {diff_id}"
        )
    return LayerStats(
        actual,
        hashing.count,
        applier.entries,
        applier.file_bytes,
        whiteouts,
        applier.xattrs_skipped,
    )


def scan_layer(blob: Path, what: str = "layer", *, hash: bool = True) -> LayerStats:
    """Read a layer without applying it: diffID, sizes and the number of entries. Without
    `hash` the diffID is left empty (``"sha256:"``): for a caller whose apply checks it."""
    with open_uncompressed(blob) as raw:
        hashing = HashingReader(raw, hash=hash)
        try:
            stream = io.BufferedReader(hashing, COPY_CHUNK)
            entries = 0
            file_bytes = 0
            for _tar, member in _members(stream, what):
                entries += 1
                if member.isreg():
                    file_bytes += member.size
            try:
                actual = hashing.finish()
            except _BAD_STREAM as exc:
                raise LayerError(f"{what}: truncated layer archive ({exc})") from None
        finally:
            hashing.close()
    return LayerStats(actual, hashing.count, entries, file_bytes)
