"""A repository snapshot of a paused sandbox, taken from its files: what a fork of a paused
sandbox restores its children from (`fork.fork_paused`).

No QEMU runs and nothing of the paused sandbox changes: its disk upper is copied into the
layer store (`LayerStore.add` copies), its device state is copied and its memory file is
cloned into the snapshot (a reflink where the filesystem has them, e.g. XFS or btrfs, so the
snapshot shares the parent's blocks copy-on-write; else a copy of the data extents only, so
the holes of RAM the guest never touched cost nothing). The children map the snapshot's
memory privately, as every restore does: they share it copy-on-write among themselves, and
the parent, which maps its own file shared again when it resumes, never sees their writes
nor they its.

A RAM stream not yet converted (the first pause of a sandbox created from a template) is
converted first (`pause.convert_stream`, as the node's background conversion would). A
filesystem-only pause has no memory to fork from (`NoMemory`).

Crash safety: the paused sandbox's files are only read, and the snapshot appears in the
catalog in one step (`SnapshotRepository.commit`); a crash leaves at most a staging
directory (removed by `gc`) and a layer nothing holds.
"""

from __future__ import annotations

import asyncio
import errno
import fcntl
import logging
import os
import shutil
import time
from collections.abc import Sequence
from pathlib import Path

from agentenv.files import SandboxFiles
from agentenv.guest.envd import ENVD_VERSION
from agentenv.snapshot.capture import Capture
from agentenv.snapshot.errors import SnapshotError
from agentenv.snapshot.machine import GuestImage
from agentenv.snapshot.model import Snapshot
from agentenv.snapshot.pause import (
    DISK,
    STATE,
    STREAM,
    check_paused,
    convert_stream,
    paused_state,
)
from agentenv.snapshot.repository import MEMORY, SnapshotStore
from agentenv.snapshot.repository import STATE as SNAP_STATE
from agentenv.storage import LayerStore
from agentenv.vmm.confine import disown

log = logging.getLogger(__name__)

# linux/fs.h: _IOW(0x94, 9, int)
FICLONE = 0x40049409
# What a filesystem without reflinks (ext4, tmpfs) or a clone across filesystems answers.
_NO_CLONE = {errno.EOPNOTSUPP, errno.ENOTTY, errno.EXDEV, errno.EINVAL, errno.ENOSYS}


class NoMemory(SnapshotError):
    """The paused sandbox kept only its disk (a filesystem-only pause): nothing to fork."""


def clone_file(src: Path, dest: Path) -> bool:
    """`dest` (new) gets `src`'s content: a reflink if the filesystem can (True), else a copy
    of its data extents that keeps its holes (False)."""
    with src.open("rb") as fin, dest.open("xb") as fout:
        try:
            fcntl.ioctl(fout.fileno(), FICLONE, fin.fileno())
            return True
        except OSError as exc:
            if exc.errno not in _NO_CLONE:
                raise
        size = os.fstat(fin.fileno()).st_size
        pos = 0
        while pos < size:
            try:
                start = os.lseek(fin.fileno(), pos, os.SEEK_DATA)
            except OSError as exc:
                if exc.errno == errno.ENXIO:  # only a hole is left
                    break
                raise
            end = os.lseek(fin.fileno(), start, os.SEEK_HOLE)
            off = start
            while off < end:
                n = os.copy_file_range(fin.fileno(), fout.fileno(), end - off, off, off)
                if n == 0:
                    raise SnapshotError(f"{src} shrank while it was copied")
                off += n
            pos = end
        os.ftruncate(fout.fileno(), size)
    return False


async def capture_paused(
    workdir: Path,
    repo: SnapshotStore,
    layers: LayerStore,
    image: GuestImage,
    *,
    holders: Sequence[str] = (),
    envd_token: str | None = None,
) -> Capture:
    """A snapshot of the sandbox paused in `workdir` (which stays paused, untouched but for
    the conversion of a RAM stream); `holders` take a reference on it as it is committed.
    The caller makes sure nothing resumes, converts or deletes the sandbox meanwhile."""
    t0 = time.monotonic()
    record = await asyncio.to_thread(paused_state, workdir)
    if record is None:
        raise SnapshotError(f"{workdir.name} is not paused")
    if record.kind == DISK:
        raise NoMemory(
            f"sandbox {workdir.name} was paused without its memory (filesystem only): a fork "
            "needs a pause that kept it"
        )
    if record.kind == STREAM:
        # The converter QEMU reads the upper under its own uid: one pulled from object
        # storage is the server's alone so far (a paused guest's own upper is handed over
        # by the converter's start; the resume gives it back to its guest either way).
        await asyncio.to_thread(disown, workdir / record.upper)
        await convert_stream(workdir, image)
        record = await asyncio.to_thread(paused_state, workdir)
        if record is None or record.kind != STATE:
            raise SnapshotError(f"sandbox {workdir.name}: its RAM stream was not converted")
    check_paused(record, image)
    digest = await asyncio.to_thread(layers.add, workdir / record.upper)
    chain = await asyncio.to_thread(layers.chain, digest)
    draft = Snapshot(
        id="",
        layers=list(reversed(chain)),
        vcpus=record.vcpus,
        memory_mb=record.memory_mb,
        balloon=record.balloon,
        tools_image=record.tools_image,
        accel=record.accel,
        qemu_version=record.qemu_version,
        device_set=record.device_set,
        envd_version=ENVD_VERSION,
        memory_bytes=0,
        state_bytes=0,
        source=record.name,
        holders=list(holders),
        envd_token=envd_token,
    )
    memory = SandboxFiles(workdir).memory
    # The same paused state forked again: its snapshot is there already (the id hashes the
    # memory's data, ~0.1 s per 100 MiB touched, where a copy takes ~1 s on ext4).
    found = await asyncio.to_thread(repo.adopt, draft, memory, workdir / STATE)
    if found is not None:
        log.info("paused %s: snapshot %s again", record.name, found.id[:12])
        return Capture(found, 0.0, time.monotonic() - t0)
    staging = await asyncio.to_thread(repo.stage)
    try:
        reflinked = await asyncio.to_thread(clone_file, memory, staging / MEMORY)
        await asyncio.to_thread(shutil.copyfile, workdir / STATE, staging / SNAP_STATE)
        snap = await asyncio.to_thread(repo.commit, staging, draft)
    except BaseException:
        await asyncio.to_thread(repo.discard, staging)
        raise
    total = time.monotonic() - t0
    log.info("paused %s captured as %s (memory %s, %.0f MiB) in %.3fs", record.name,
             snap.id[:12], "reflinked" if reflinked else "copied",
             snap.memory_bytes / 2**20, total)  # fmt: skip
    return Capture(snap, 0.0, total)
