"""Flushing a guest's page cache onto its virtual disk, before a filesystem-only pause or
snapshot stops its QEMU.

Two caches sit between a guest process's write and the qcow2 file on the host, and each needs
its own flush:

1. The guest kernel's page cache (dirty pages, the ext4 journal): only the guest can write it
   out, so `sync` runs in the guest through envd (no guest agent on the QMP side could).
2. QEMU's block layer (qcow2 L2/refcount caches, data the host has not written back): QMP
   `stop` drains every in-flight request and flushes all block devices before it returns
   (QEMU's `do_vm_stop` calls `bdrv_drain_all` and `bdrv_flush_all`), so once the guest is
   stopped its upper is complete on disk and killing QEMU loses nothing.

A guest that keeps writing between the two is caught at the stop: the disk is then as after a
power cut at that moment, which ext4's journal recovers at the next boot (E2B's
"crash-recovery semantics" of a filesystem-only resume).
"""

from __future__ import annotations

from agentenv.guest.envd.client import EnvdClient, EnvdError
from agentenv.snapshot.errors import SnapshotError

# A sync under TCG with a few hundred MB dirty takes seconds; a hung guest must not hold the
# pause forever.
SYNC_TIMEOUT_S = 60.0
# From the tools layer, so it works whatever the rootfs has on its PATH.
SYNC = "/.agentenv/bin/busybox sync"


class GuestSyncFailed(SnapshotError):
    """envd did not answer or the guest's `sync` failed: its disk may lack recent writes."""


async def guest_sync(
    envd_url: str, access_token: str | None, timeout_s: float = SYNC_TIMEOUT_S
) -> None:
    """Write the guest's dirty pages to its disk; returns once the guest's `sync` ended."""
    try:
        async with EnvdClient(envd_url, access_token, timeout=timeout_s) as envd:
            res = await envd.run(SYNC, user="root", timeout=timeout_s, shell="/bin/sh")
    except EnvdError as exc:
        raise GuestSyncFailed(f"the guest's disk could not be synced through envd: {exc}") from exc
    if res.exit_code != 0:
        detail = (res.stderr.strip().splitlines() or [f"exit code {res.exit_code}"])[-1]
        raise GuestSyncFailed(f"the guest's sync failed: {detail}")
