"""A running guest's drives over QMP: the block-node chain (learnt again on adopt),
sealing the writable upper under a new overlay, IO limits, growing a drive. Split from
`qemu.py`: everything that names a drive's node or file."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

from agentenv.storage.images import create_overlay_sync
from agentenv.vmm import confine as vm_confine
from agentenv.vmm.base import DiskLimits
from agentenv.vmm.errors import VMMError
from agentenv.vmm.qemu_base import QemuBase


class QemuDisks(QemuBase):
    """The drive operations of a `QemuVM`."""

    async def _learn_block_nodes(self) -> None:
        reply = await self._execute("query-block")
        assert isinstance(reply, list)
        for entry in reply:
            inserted = entry.get("inserted") if isinstance(entry, dict) else None
            if not isinstance(inserted, dict):
                continue
            node = str(inserted.get("node-name", ""))
            drive_id, _, n = node.rpartition("-")
            if drive_id in self._top and n.isdigit():
                self._top[drive_id] = node
                self._seals[drive_id] = int(n)
                self._paths[drive_id] = self._from_vm(Path(str(inserted["file"])))

    async def seal_disk(self, drive_id: str, new_upper: Path) -> Path:
        if drive_id not in self._top:
            raise VMMError(f"{self.name} has no drive {drive_id!r}")
        if self.confine and not new_upper.is_relative_to(self.workdir):
            # A confined QEMU's root has its workdir, not the rest of the host.
            raise VMMError(f"{self.name}: a new upper must be in {self.workdir}, not {new_upper}")
        old_path = self._paths[drive_id]
        await asyncio.to_thread(create_overlay_sync, old_path, new_upper)
        if self.confine:
            await asyncio.to_thread(vm_confine.give, new_upper, self.uid, self.gid)
        n = self._seals[drive_id] + 1
        node = f"{drive_id}-{n}"
        try:
            await self._execute(
                "blockdev-add",
                {
                    "driver": "qcow2",
                    "node-name": node,
                    "file": {
                        "driver": "file",
                        "filename": str(self._in_vm(new_upper)),
                        "auto-read-only": True,
                    },
                    # The overlay's backing is the live node, attached by blockdev-snapshot.
                    "backing": None,
                },
            )
            try:
                await self._execute(
                    "blockdev-snapshot", {"node": self._top[drive_id], "overlay": node}
                )
            except BaseException:
                with contextlib.suppress(Exception):
                    await self._execute("blockdev-del", {"node-name": node})
                raise
        except BaseException:
            await asyncio.to_thread(new_upper.unlink, True)
            raise
        self._seals[drive_id] = n
        self._top[drive_id] = node
        self._paths[drive_id] = new_upper
        # QEMU now opens the old upper read-only; the file mode keeps everyone else honest,
        # and a confined QEMU no longer owns it (so cannot make it writable again).
        if self.confine:
            await asyncio.to_thread(vm_confine.disown, old_path)
        await asyncio.to_thread(old_path.chmod, 0o444)
        return old_path

    async def _throttle_disks(self, limits: DiskLimits) -> None:
        # On the device's BlockBackend (named by the qdev id), not on a node: a seal's
        # `blockdev-snapshot` puts a new top under the same backend, which keeps the limit
        # (checked by `query-block`, tests/vmm). All zeros turns throttling off. Not migrated
        # state: a restored guest gets it from its own QEMU's start.
        for d in self.drives:
            if d.read_only:
                continue
            await self._execute(
                "block_set_io_throttle",
                {
                    "id": d.id,
                    "bps": limits.bytes_per_s,
                    "bps_rd": 0,
                    "bps_wr": 0,
                    "iops": limits.iops,
                    "iops_rd": 0,
                    "iops_wr": 0,
                },
            )

    async def set_disk_limits(self, limits: DiskLimits | None) -> None:
        """Change the IO limits of every writable drive while QEMU runs (None: none)."""
        await self._throttle_disks(limits or DiskLimits())
        self.disk_limits = limits
        await asyncio.to_thread(self._write_record)

    async def disk_limits_in_effect(self) -> dict[str, DiskLimits]:
        """What QEMU enforces now, per drive id (`query-block`; zeros: none)."""
        reply = await self._execute("query-block")
        found: dict[str, DiskLimits] = {}
        for entry in reply if isinstance(reply, list) else []:
            inserted = entry.get("inserted") if isinstance(entry, dict) else None
            # The qdev id itself here (7.2); a QOM path names it as one of its parts.
            qdev = str(entry.get("qdev", "")) if isinstance(entry, dict) else ""
            drive = next((p for p in [qdev, *qdev.split("/")] if p in self._top), None)
            if isinstance(inserted, dict) and drive is not None:
                found[drive] = DiskLimits(int(inserted.get("bps", 0)), int(inserted.get("iops", 0)))
        return found

    def disk_path(self, drive_id: str) -> Path:
        """The file that currently takes the drive's writes."""
        return self._paths[drive_id]

    async def resize_disk(self, drive_id: str, size_bytes: int) -> None:
        """Grow the drive's writable top to `size_bytes` while the guest runs. The device
        tells the guest (virtio config change), whose kernel takes the new capacity; a
        restored guest needs this because its device state carries the old one."""
        if drive_id not in self._top:
            raise VMMError(f"{self.name} has no drive {drive_id!r}")
        await self._execute("block_resize", {"node-name": self._top[drive_id], "size": size_bytes})
