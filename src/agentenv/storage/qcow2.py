"""qcow2 headers in-process: read an image's metadata and write an empty overlay, no qemu-img.

The layout follows QEMU's docs/interop/qcow2.txt. An empty overlay over a backing file is
what `qemu-img create -f qcow2 -b <backing> -F <fmt>` writes: a version 3 header in cluster
0 (with the backing format as a header extension and the backing file name after it), a
one-cluster refcount table in cluster 1, its one refcount block in cluster 2, and a zeroed
L1 table from cluster 3 on. Every cluster in the file is counted once, so `qemu-img check`
finds no leak; every L1 entry is zero, so every read falls through to the backing file.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path

MAGIC = 0x514649FB
CLUSTER_BITS = 16
CLUSTER_SIZE = 1 << CLUSTER_BITS
REFCOUNT_ORDER = 4  # 16-bit refcounts, QEMU's default
V3_HEADER_LENGTH = 104
V2_HEADER_LENGTH = 72
EXT_END = 0x00000000
EXT_BACKING_FORMAT = 0xE2792ACA
# Fields 0..103 of a version 3 header (docs/interop/qcow2.txt, "Header").
_HEADER = struct.Struct(">IIQIIQIIQQIIQQQQII")
_HEADER_V2 = struct.Struct(">IIQIIQIIQQII")  # bytes 0..71
_EXT = struct.Struct(">II")
_MAX_BACKING_NAME = 1023  # QEMU's own limit


class Qcow2Error(Exception):
    """The file is not a qcow2 image this module can read or write."""


@dataclass(frozen=True)
class Header:
    version: int
    virtual_size: int
    backing_file: str | None
    backing_format: str | None


def is_qcow2(path: Path) -> bool:
    with path.open("rb") as fh:
        head = fh.read(4)
    return len(head) == 4 and struct.unpack(">I", head)[0] == MAGIC


def read_header(path: Path) -> Header:
    """The virtual size, backing file name (as stored) and backing format of a qcow2 image."""
    with path.open("rb") as fh:
        raw = fh.read(CLUSTER_SIZE)
        if len(raw) < V2_HEADER_LENGTH:
            raise Qcow2Error(f"{path}: too short for a qcow2 header")
        fields = _HEADER_V2.unpack_from(raw)
        magic, version, backing_off, backing_len, cluster_bits, size = fields[:6]
        if magic != MAGIC:
            raise Qcow2Error(f"{path}: not a qcow2 image")
        if version not in (2, 3):
            raise Qcow2Error(f"{path}: qcow2 version {version} is not supported")
        header_length = V2_HEADER_LENGTH
        if version == 3:
            if len(raw) < V3_HEADER_LENGTH:
                raise Qcow2Error(f"{path}: truncated version 3 header")
            header_length = struct.unpack_from(">I", raw, 100)[0]
        cluster_size = 1 << cluster_bits
        backing: str | None = None
        if backing_off:
            if backing_len > _MAX_BACKING_NAME or backing_off + backing_len > cluster_size:
                raise Qcow2Error(f"{path}: backing file name out of bounds")
            if backing_off + backing_len > len(raw):
                fh.seek(backing_off)
                name = fh.read(backing_len)
            else:
                name = raw[backing_off : backing_off + backing_len]
            backing = name.decode()
        fmt = _backing_format(raw, header_length, path)
    return Header(version=version, virtual_size=size, backing_file=backing, backing_format=fmt)


def _backing_format(raw: bytes, offset: int, path: Path) -> str | None:
    while offset + _EXT.size <= len(raw):
        ext_type, ext_len = _EXT.unpack_from(raw, offset)
        offset += _EXT.size
        if ext_type == EXT_END:
            return None
        if offset + ext_len > len(raw):
            raise Qcow2Error(f"{path}: header extension out of bounds")
        if ext_type == EXT_BACKING_FORMAT:
            return raw[offset : offset + ext_len].decode()
        offset += (ext_len + 7) & ~7
    return None


def _div_up(a: int, b: int) -> int:
    return -(-a // b)


def overlay_bytes(virtual_size: int, backing_file: str, backing_format: str) -> bytes:
    """The whole file of an empty qcow2 (v3, 64 KiB clusters) over `backing_file`."""
    if virtual_size <= 0:
        raise Qcow2Error(f"virtual size must be positive, got {virtual_size}")
    name = backing_file.encode()
    fmt = backing_format.encode()
    if not name or len(name) > _MAX_BACKING_NAME:
        raise Qcow2Error(f"backing file name of {len(name)} bytes is out of range")
    l2_entries = CLUSTER_SIZE // 8
    l1_size = _div_up(virtual_size, CLUSTER_SIZE * l2_entries)
    l1_clusters = max(1, _div_up(l1_size * 8, CLUSTER_SIZE))
    reftable_off, refblock_off, l1_off = CLUSTER_SIZE, 2 * CLUSTER_SIZE, 3 * CLUSTER_SIZE
    n_clusters = 3 + l1_clusters
    refs_per_block = CLUSTER_SIZE * 8 // (1 << REFCOUNT_ORDER)
    if n_clusters > refs_per_block:
        raise Qcow2Error(f"virtual size {virtual_size} needs more than one refcount block")

    exts = _EXT.pack(EXT_BACKING_FORMAT, len(fmt)) + fmt + b"\0" * (-len(fmt) % 8)
    exts += _EXT.pack(EXT_END, 0)
    backing_off = V3_HEADER_LENGTH + len(exts)
    if backing_off + len(name) > CLUSTER_SIZE:
        raise Qcow2Error("header does not fit in one cluster")
    header = _HEADER.pack(
        MAGIC,
        3,  # version
        backing_off,
        len(name),
        CLUSTER_BITS,
        virtual_size,
        0,  # crypt_method
        l1_size,
        l1_off,
        reftable_off,
        1,  # refcount_table_clusters
        0,  # nb_snapshots
        0,  # snapshots_offset
        0,  # incompatible_features
        0,  # compatible_features
        0,  # autoclear_features
        REFCOUNT_ORDER,
        V3_HEADER_LENGTH,
    )
    out = bytearray(n_clusters * CLUSTER_SIZE)
    first = header + exts + name
    out[: len(first)] = first
    struct.pack_into(">Q", out, reftable_off, refblock_off)
    for i in range(n_clusters):
        struct.pack_into(">H", out, refblock_off + 2 * i, 1)
    return bytes(out)


def write_overlay(dest: Path, virtual_size: int, backing_file: str, backing_format: str) -> None:
    """Create `dest` (it must not exist) as an empty overlay; a failed write leaves nothing."""
    data = overlay_bytes(virtual_size, backing_file, backing_format)
    fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        # Sparse: size the file, then write only the non-zero start of each metadata cluster.
        os.ftruncate(fd, len(data))
        for start in range(0, 3 * CLUSTER_SIZE, CLUSTER_SIZE):
            chunk = data[start : start + CLUSTER_SIZE].rstrip(b"\0")
            written = 0
            while written < len(chunk):
                written += os.pwrite(fd, chunk[written:], start + written)
    except BaseException:
        os.close(fd)
        dest.unlink(missing_ok=True)
        raise
    os.close(fd)
