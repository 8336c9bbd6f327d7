"""Read-only block layers for an image, one per prefix of its layer list, keyed by chain id.

The chain id of layers ``L1..Ln`` is OCI's ChainID: ``ChainID(L1) = DiffID(L1)``,
``ChainID(L1..Ln) = sha256(ChainID(L1..Ln-1) + " " + DiffID(Ln))``. The block layer of a
chain is an ext4 filesystem holding the merged tree of ``L1..Ln``, stored in the
`LayerStore` as a qcow2 whose backing file is the block layer of ``L1..Ln-1``; it holds only
the clusters that applying ``Ln`` changed. Two images whose first k layers are the same have
the same first k chain ids, so they share those qcow2 files on disk and, since every sandbox
of either reads them, in the host page cache.

How a layer is written (no NBD on this host kernel, no guestfish):

* the bottom layer: a sparse raw file, ``mkfs.ext4``, loop-mounted, the layer applied with
  `agentenv.oci.unpack`, unmounted, ``qemu-img convert`` to qcow2 (zero clusters dropped);
* every other layer: ``qemu-img create -b <parent>`` makes an empty overlay, which
  ``qemu-storage-daemon`` exports through FUSE as a raw file; that file is loop-mounted (the
  kernel's ext4 does the writes, so owners, devices and xattrs are native), the layer is
  applied, and unmounting + stopping the daemon leaves exactly the changed clusters in the
  overlay. If the layer may not fit, the overlay is made larger than its parent and the
  mounted filesystem is grown with ``resize2fs``.

Before a layer is written it is scanned (entries and bytes, for the filesystem size); the
scan of the next layer runs while the current one is written, and the diffID is checked by
the apply itself (it hashes the stream it reads), so each layer is decompressed twice but
only the first scan is on the critical path.

Each chain is built under a per-chain file lock, in a scratch dir under ``oci/tmp``, and
only recorded (``oci/chains/<hex>.json``, held in the store as ``oci-chain:<chain id>``)
once it is complete, so a crash leaves at most scratch files (removed by the next build).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import hashlib
import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from agentenv.filelock import file_lock
from agentenv.oci.cache import CHAIN_HOLDER, ImageCache
from agentenv.oci.errors import OciError
from agentenv.oci.progress import CONVERT, LayerProgress, LayerProgressFn
from agentenv.oci.unpack import LayerStats, apply_layer, scan_layer
from agentenv.storage.errors import StorageError
from agentenv.template.progress import ProgressFn, report

MIB = 1024 * 1024
MIN_FS_BYTES = 1024 * MIB
FS_ROUND = 256 * MIB
# Per-entry allowance for inodes, directory blocks and block rounding.
ENTRY_OVERHEAD = 4096
FS_LABEL = "rootfs"
BYTES_PER_INODE = 8192
# Room above the content for ext4's journal and metadata.
FS_SLACK = 64 * MIB
BUILD_LOCK_TIMEOUT_S = 3600.0
CMD_TIMEOUT_S = 1800.0
QSD_STOP_S = 30.0
# Below this much free space on a filesystem a failed layer build is put down to a full disk.
LOW_SPACE_BYTES = 64 * MIB
_libc = ctypes.CDLL(None, use_errno=True)
# How long an unmount waits for another process to leave the mounted directory.
UMOUNT_BUSY_S = 10.0


def chain_ids(diff_ids: list[str] | tuple[str, ...]) -> list[str]:
    out: list[str] = []
    for diff_id in diff_ids:
        if not out:
            out.append(diff_id)
        else:
            out.append("sha256:" + hashlib.sha256(f"{out[-1]} {diff_id}".encode()).hexdigest())
    return out


@dataclass(frozen=True)
class ChainLayer:
    chain_id: str
    diff_id: str
    parent: str | None  # the chain id below, None for the bottom layer
    layer: str  # the layer store digest of the qcow2
    virtual_size: int  # bytes of the ext4 filesystem
    used_bytes: int  # bytes the filesystem uses once the chain is applied
    stored_bytes: int  # bytes the qcow2 takes on disk (this layer alone)
    build_s: float

    @property
    def size_mb(self) -> int:
        return -(-self.virtual_size // MIB)


def _run(args: list[str], what: str) -> str:
    try:
        proc = subprocess.run(
            args, capture_output=True, text=True, timeout=CMD_TIMEOUT_S, check=False
        )
    except FileNotFoundError:
        raise OciError(f"{what}: {args[0]} is not installed") from None
    except subprocess.TimeoutExpired:
        raise OciError(f"{what}: {args[0]} timed out after {CMD_TIMEOUT_S:.0f}s") from None
    if proc.returncode != 0:
        tail = (proc.stderr.strip() or proc.stdout.strip() or "no output").splitlines()[-1]
        raise OciError(f"{what}: {' '.join(args[:2])} failed: {tail}")
    return proc.stdout


def _round_up(n: int) -> int:
    return -(-n // FS_ROUND) * FS_ROUND


def fs_size_for(used: int, stats: LayerStats, current: int) -> int:
    """The filesystem size a layer needs on top of `used` bytes (never below `current`)."""
    need = used + stats.file_bytes + stats.entries * ENTRY_OVERHEAD + FS_SLACK
    if current and need * 5 // 4 <= current:
        return current
    return max(current, MIN_FS_BYTES, _round_up(need * 3 // 2))


@contextlib.contextmanager
def _loop_mounted(image: Path, mountpoint: Path, what: str, *, grow: bool = False) -> Iterator[str]:
    """`image` on a loop device, mounted at `mountpoint`; yields the loop device. `grow`
    first extends the filesystem to the whole device (offline: online resizing refuses some
    layouts, and the filesystem is not in use yet)."""
    device = _run(["losetup", "--find", "--show", str(image)], what).strip()
    try:
        if grow:
            # resize2fs wants a checked filesystem; -p only fixes what is safe to fix.
            _run(["e2fsck", "-f", "-p", device], what)
            _run(["resize2fs", device], what)
        mountpoint.mkdir(exist_ok=True)
        # noinit_itable: the kernel's lazy inode table init would otherwise write zeros
        # into the layer in the background.
        _run(["mount", "-t", "ext4", "-o", "noinit_itable", device, str(mountpoint)], what)
        # Opened before anything is written: syncfs reports the writeback errors seen since.
        fd = os.open(mountpoint, os.O_RDONLY | os.O_DIRECTORY)
        try:
            yield device
            _check_written(fd, device, what)
        finally:
            os.close(fd)
            _umount(mountpoint, what)
    finally:
        subprocess.run(["losetup", "-d", device], capture_output=True, check=False, timeout=60)


def _umount(mountpoint: Path, what: str) -> None:
    """Unmount, waiting out a short EBUSY: any process on the host that walks the directory
    (du, a backup or indexing agent) holds the mount for as long as it is inside, and a
    layer whose filesystem stays mounted cannot be discarded."""
    deadline = time.monotonic() + UMOUNT_BUSY_S
    while True:
        if _libc.umount2(os.fsencode(mountpoint), 0) == 0:
            return
        err = ctypes.get_errno()
        if err != errno.EBUSY or time.monotonic() >= deadline:
            raise OciError(f"{what}: umount {mountpoint} failed: {os.strerror(err)}")
        time.sleep(0.1)


def _check_written(fd: int, device: str, what: str) -> None:
    """Raise if any write into the mounted layer was lost. A loop device over a full host
    filesystem fails its writes in the background (the kernel logs them, the writer's
    ``write()`` had already succeeded and ``umount`` still succeeds), which would leave a
    layer with holes in it: flush now and look at what the flush and ext4 report."""
    if _libc.syncfs(fd) != 0:
        err = ctypes.get_errno()
        raise OciError(f"{what}: writing the filesystem failed: {os.strerror(err)}")
    try:
        count = int(Path(f"/sys/fs/ext4/{Path(device).name}/errors_count").read_text())
    except (OSError, ValueError):
        count = 0
    if count:
        raise OciError(f"{what}: ext4 recorded {count} errors while the layer was written")


def space_hint(paths: list[Path]) -> str | None:
    """ "<path> is full (N MB free)" for the first of `paths` whose filesystem is nearly full."""
    for path in paths:
        try:
            st = os.statvfs(path)
        except OSError:
            continue
        free = st.f_bavail * st.f_frsize
        if free < LOW_SPACE_BYTES:
            return f"the host filesystem of {path} is full ({free // MIB} MB free)"
    return None


def with_space_hint(exc: BaseException, paths: list[Path]) -> OciError | None:
    """An `OciError` naming a full host disk as the cause of `exc`, if one is (or `exc` is
    ENOSPC); None otherwise."""
    hint = space_hint(paths)
    if hint is None and isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
        hint = "no space left on the host disk"
    return OciError(f"{exc}; {hint}") if hint else None


@contextlib.contextmanager
def _fuse_export(qcow2: Path, export: Path, what: str) -> Iterator[None]:
    """`qcow2` writable as a raw file at `export`, served by qemu-storage-daemon."""
    export.touch()
    pidfile = export.with_suffix(".pid")
    _run(
        [
            "qemu-storage-daemon",
            "--blockdev",
            f"driver=file,node-name=file,filename={qcow2},cache.direct=off",
            "--blockdev",
            "driver=qcow2,node-name=disk,file=file,detect-zeroes=on",
            "--export",
            f"type=fuse,id=exp,node-name=disk,mountpoint={export},writable=on",
            "--daemonize",
            "--pidfile",
            str(pidfile),
        ],
        what,
    )
    pid = int(pidfile.read_text().strip())
    try:
        yield
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + QSD_STOP_S
        while time.monotonic() < deadline and _alive(pid):
            time.sleep(0.05)
        if _alive(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            raise OciError(f"{what}: qemu-storage-daemon {pid} did not stop; layer discarded")
        # The daemon unmounts its FUSE export on exit; a killed one leaves it mounted.
        subprocess.run(["umount", "-l", str(export)], capture_output=True, check=False)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def _used_bytes(mountpoint: Path) -> int:
    st = os.statvfs(mountpoint)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def _stored_bytes(path: Path) -> int:
    return path.stat().st_blocks * 512


class ChainBuilder:
    def __init__(self, cache: ImageCache) -> None:
        self.cache = cache
        self.tmp = cache.root / "tmp"

    def get(self, chain_id: str) -> ChainLayer | None:
        """The recorded block layer of `chain_id`, if its qcow2 is still in the store."""
        path = self.cache.chain_record(chain_id)
        if not path.is_file():
            return None
        layer = ChainLayer(**json.loads(path.read_text()))
        try:
            self.cache.layers.path(layer.layer)
        except StorageError:
            return None
        return layer

    async def ensure(
        self,
        layers: list[tuple[Path, str]],
        progress: ProgressFn | None = None,
        layer_progress: LayerProgressFn | None = None,
    ) -> list[ChainLayer]:
        """Block layers for every prefix of `layers` ((blob path, diffID), bottom first).
        `layer_progress` gets CONVERT reports (uncompressed bytes applied) per layer; the
        blob's digest is its cache file name."""
        ids = chain_ids([d for _, d in layers])
        n = len(layers)
        out: list[ChainLayer] = []
        scans: dict[int, asyncio.Future[LayerStats]] = {}

        def scan(i: int) -> None:
            # Started early so it overlaps the build of the layer below.
            if i < n and i not in scans and self.get(ids[i]) is None:
                scans[i] = asyncio.ensure_future(
                    asyncio.to_thread(scan_layer, layers[i][0], f"layer {i + 1}", hash=False)
                )

        def reporter(i: int, total: int) -> Callable[[int], None]:
            digest = "sha256:" + layers[i][0].name

            def fn(done: int) -> None:
                if layer_progress is not None:
                    layer_progress(LayerProgress(CONVERT, i, n, digest, done, total))

            return fn

        try:
            for i, ((blob, diff_id), chain_id) in enumerate(zip(layers, ids, strict=True)):
                found = self.get(chain_id)
                if found is None:
                    async with file_lock(
                        self.cache.lock_path(chain_id),
                        name=f"the block layer build lock of {chain_id}",
                        timeout_s=BUILD_LOCK_TIMEOUT_S,
                        waiter=f"layer {i + 1} of {len(layers)}",
                    ):
                        found = self.get(chain_id)
                        if found is None:
                            report(progress, f"block layer {i + 1}/{n} ({diff_id[:19]})")
                            scan(i)
                            stats = await scans.pop(i)
                            scan(i + 1)
                            parent = out[-1] if out else None
                            found = await asyncio.to_thread(
                                self._build, blob, diff_id, chain_id, parent, stats,
                                reporter(i, stats.uncompressed_bytes),
                            )  # fmt: skip
                            # (the apply reported this layer's last bytes)
                            out.append(found)
                            continue
                if layer_progress is not None:
                    digest = "sha256:" + blob.name
                    layer_progress(LayerProgress(CONVERT, i, n, digest, 1, 1, cached=True))
                out.append(found)
        finally:
            # A scan started for a layer that is no longer built (an error above) still
            # runs in its thread: wait for it rather than leave it reading behind us.
            await asyncio.gather(*scans.values(), return_exceptions=True)
        await asyncio.to_thread(self.cache.touch, [f"chain:{c.chain_id}" for c in out])
        return out

    def _build(
        self,
        blob: Path,
        diff_id: str,
        chain_id: str,
        parent: ChainLayer | None,
        stats: LayerStats | None = None,
        progress: Callable[[int], None] | None = None,
    ) -> ChainLayer:
        what = f"block layer {chain_id}"
        started = time.monotonic()
        if stats is None:
            stats = scan_layer(blob, what, hash=False)
        self.tmp.mkdir(parents=True, exist_ok=True)
        scratch = self.tmp / f"{chain_id.split(':')[1][:16]}-{os.getpid()}"
        shutil.rmtree(scratch, ignore_errors=True)
        scratch.mkdir()
        try:
            mnt = scratch / "mnt"
            qcow2 = scratch / "layer.qcow2"
            if parent is None:
                size = fs_size_for(0, stats, 0)
                raw = scratch / "fs.raw"
                with raw.open("wb") as fh:
                    fh.truncate(size)
                _run(
                    [
                        "mkfs.ext4", "-q", "-F", "-L", FS_LABEL, "-b", "4096", "-T", "default",
                        "-i", str(BYTES_PER_INODE),
                        "-E", "lazy_itable_init=0,lazy_journal_init=1", str(raw),
                    ],
                    what,
                )  # fmt: skip
                with _loop_mounted(raw, mnt, what):
                    apply_layer(mnt, blob, diff_id=diff_id, what=what, progress=progress)
                    used = _used_bytes(mnt)
                # The store converts a raw image to qcow2 itself (zero clusters dropped),
                # straight into its own file: no intermediate qcow2 to copy in.
                image = raw
            else:
                size = fs_size_for(parent.used_bytes, stats, parent.virtual_size)
                backing = self.cache.layers.path(parent.layer)
                _run(
                    [
                        "qemu-img", "create", "-q", "-f", "qcow2", "-F", "qcow2",
                        "-b", str(backing), str(qcow2), str(size),
                    ],
                    what,
                )  # fmt: skip
                export = scratch / "disk.raw"
                with (
                    _fuse_export(qcow2, export, what),
                    _loop_mounted(export, mnt, what, grow=size > parent.virtual_size),
                ):
                    apply_layer(mnt, blob, diff_id=diff_id, what=what, progress=progress)
                    used = _used_bytes(mnt)
                image = qcow2
            digest = self.cache.layers.add(image)
            self.cache.layers.ref(digest, CHAIN_HOLDER + chain_id)
            stored = _stored_bytes(self.cache.layers.path(digest))
            layer = ChainLayer(
                chain_id=chain_id,
                diff_id=diff_id,
                parent=parent.chain_id if parent else None,
                layer=digest,
                virtual_size=size,
                used_bytes=used,
                stored_bytes=stored,
                build_s=round(time.monotonic() - started, 3),
            )
            record = self.cache.chain_record(chain_id)
            tmp = record.with_suffix(".tmp")
            tmp.write_text(json.dumps(asdict(layer), indent=1))
            os.replace(tmp, record)
            self.cache.record(f"chain:{chain_id}", "chain", stored)
            return layer
        except (OciError, OSError, StorageError) as exc:
            if isinstance(exc, OSError) and exc.errno == errno.EROFS:
                # ext4 turns the layer read-only once the loop device under it lost a write
                # (a full host disk): the same failure `_check_written` reports at the end,
                # met earlier when the kernel wrote back before the extraction finished.
                exc = OciError(f"{what}: writing the filesystem failed: {exc.strerror}")
            # Asked before the scratch files go, while a full disk is still full.
            named = with_space_hint(exc, [self.tmp, self.cache.layers.root])
            if named is not None:
                raise named from exc
            raise
        finally:
            # Never recurse into a filesystem that failed to unmount.
            if not any(os.path.ismount(p) for p in (scratch / "mnt", scratch / "disk.raw")):
                shutil.rmtree(scratch, ignore_errors=True)
