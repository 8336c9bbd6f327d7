"""Guest state in and out of a file over QMP migration: snapshots (device state only, RAM
in the shared memory file) and RAM streams, written and read through descriptors handed to
QEMU. Split from `qemu.py`: the migration protocol and its waits."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path

from qemu.qmp import EventListener

from agentenv.vmm.errors import VMMError
from agentenv.vmm.qemu_base import QemuBase

SNAPSHOT_TIMEOUT_S = 60.0
# QEMU throttles migration to ~128 MiB/s by default; a local file takes much more.
MIGRATE_BANDWIDTH = 16 * 1024**3

# A migration that failed with less than this free where it wrote ran out of space.
FULL_BELOW_BYTES = 16 * 1024 * 1024
# A migration wakes its waiter with a MIGRATION event at each change of status; without one
# for this long the waiter asks anyway (an event lost is a slower wait, not a stuck one).
# Asking every 2 ms instead made 198 QMP round trips of one 0.76 s pause (256 MiB guest).
MIGRATION_ASK_S = 0.25


def _free_bytes(path: Path) -> int | None:
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


class QemuMigration(QemuBase):
    """Snapshot and RAM-stream save and load of a `QemuVM`."""

    async def _ignore_shared(self, on: bool = True) -> None:
        # On: RAM lives in the memory file, so migration writes device state only (~50 KB).
        # Off: RAM goes into the stream too. Both ends must agree. `events`: QEMU says when
        # the migration's status changes (`_wait_migration` waits for that).
        await self._execute(
            "migrate-set-capabilities",
            {
                "capabilities": [
                    {"capability": "x-ignore-shared", "state": on},
                    {"capability": "events", "state": True},
                ]
            },
        )

    @contextlib.asynccontextmanager
    async def _migrating(self, cmd: str, fdname: str) -> AsyncIterator[EventListener]:
        """Start `cmd` (`migrate` or `migrate-incoming`) on the descriptor passed as
        `fdname`; yields its MIGRATION events, listened for from before it starts so none
        is missed. A refused start gives the descriptor back."""
        if self._qmp is None:
            raise VMMError(f"{self.name} is not running")
        with self._qmp.listener("MIGRATION") as heard:
            try:
                await self._execute(cmd, {"uri": f"fd:{fdname}"})
            except VMMError:
                with contextlib.suppress(VMMError):
                    await self._execute("closefd", {"fdname": fdname})
                raise
            yield heard

    async def _wait_migration(self, what: str, heard: EventListener) -> None:
        """Until `query-migrate` says completed. It is asked again at each MIGRATION event
        (`heard`), or after `MIGRATION_ASK_S` without one."""
        deadline = time.monotonic() + SNAPSHOT_TIMEOUT_S
        while (left := deadline - time.monotonic()) > 0:
            heard.clear()
            reply = await self._execute("query-migrate")
            status = reply.get("status") if isinstance(reply, dict) else None
            if status == "completed":
                return
            if status in ("failed", "cancelled"):
                detail = reply.get("error-desc", status) if isinstance(reply, dict) else status
                raise VMMError(f"{self.name}: {what} failed: {detail}")
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(min(MIGRATION_ASK_S, left)):
                    await heard.get()
        raise VMMError(f"{self.name}: {what} did not finish in {SNAPSHOT_TIMEOUT_S:.0f}s")

    async def _wait_run_state_leaves(self, state: str, what: str) -> None:
        """`query-migrate` says completed before the migration thread has set the run state
        that ends it (under the big lock, a moment later), on both ends."""
        deadline = time.monotonic() + SNAPSHOT_TIMEOUT_S
        while time.monotonic() < deadline:
            reply = await self._execute("query-status")
            if isinstance(reply, dict) and reply.get("status") != state:
                return
            await asyncio.sleep(0.002)
        raise VMMError(f"{self.name}: {what} did not finish in {SNAPSHOT_TIMEOUT_S:.0f}s")

    async def _wait_incoming(self, what: str, heard: EventListener) -> None:
        # The destination applies the state after `completed`: it leaves `inmigrate` then.
        await self._wait_migration(what, heard)
        await self._wait_run_state_leaves("inmigrate", what)

    async def _pass_fd(self, fd: int) -> str:
        """Hand QEMU an open descriptor (SCM_RIGHTS on the QMP socket, then `getfd`); the
        name it is known by there. QEMU opens no file and starts no helper for a stream, so
        neither its root nor its seccomp filter needs to allow one."""
        if self._qmp is None:
            raise VMMError(f"{self.name} is not running")
        async with self._fd_lock:
            self._fd_seq += 1
            name = f"stream{self._fd_seq}"
            try:
                self._qmp.send_fd_scm(fd)
            except Exception as exc:
                raise VMMError(f"{self.name}: passing a descriptor failed: {exc}") from exc
            await self._execute("getfd", {"fdname": name})
        return name

    async def _migrate_out(self, path: Path, what: str) -> None:
        await self._execute("migrate-set-parameters", {"max-bandwidth": MIGRATE_BANDWIDTH})
        await self._execute("stop")
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC
        fd = await asyncio.to_thread(os.open, path, flags, 0o644)
        try:
            fdname = await self._pass_fd(fd)
        finally:
            os.close(fd)
        async with self._migrating("migrate", fdname) as heard:
            await self._wait_out(path, what, heard)

    async def _wait_out(self, path: Path, what: str, heard: EventListener) -> None:
        try:
            await self._wait_migration(what, heard)
            # A source still in `finish-migrate` refuses `cont` ("Migration is not finalized
            # yet"): a capture that resumes its source at once met that in CI.
            await self._wait_run_state_leaves("finish-migrate", what)
        except VMMError as exc:
            # QEMU's write fails with little detail; a full filesystem is why, and callers
            # map it.
            free = await asyncio.to_thread(_free_bytes, path.parent)
            if free is not None and free < FULL_BELOW_BYTES:
                raise VMMError(
                    f"{exc}: No space left on device ({path.parent}, {free // 1024} KiB free)"
                ) from exc
            raise

    async def _migrate_in(self, path: Path, what: str, run: bool) -> None:
        if not self.incoming:
            raise VMMError(f"{self.name} was not started to receive a snapshot")
        if not await asyncio.to_thread(path.is_file):
            raise VMMError(f"{self.name}: snapshot state {path} does not exist")
        fd = await asyncio.to_thread(os.open, path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            fdname = await self._pass_fd(fd)
        finally:
            os.close(fd)
        async with self._migrating("migrate-incoming", fdname) as heard:
            await self._wait_incoming(what, heard)
        if run:
            await self._execute("cont")

    async def snapshot_create(self, state_path: Path) -> None:
        if self.machine.mem_file is None or not self.machine.mem_shared:
            raise VMMError(f"{self.name}: snapshots need guest RAM in a shared memory file")
        await self._ignore_shared(True)
        await self._migrate_out(state_path, "snapshot")

    async def snapshot_load(self, state_path: Path, *, run: bool = True) -> None:
        if self.incoming:
            await self._ignore_shared(True)
        await self._migrate_in(state_path, "restore", run)

    async def stream_save(self, stream_path: Path) -> None:
        await self._ignore_shared(False)
        await self._migrate_out(stream_path, "RAM snapshot")

    async def stream_load(self, stream_path: Path, *, run: bool = True) -> None:
        if self.incoming:
            await self._ignore_shared(False)
        await self._migrate_in(stream_path, "RAM restore", run)
