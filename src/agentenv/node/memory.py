"""Host memory of sandboxes: what each one really costs (PSS) and giving memory back.

- `host_memory(pid)`: the QEMU process's proportional set size from `/proc/<pid>/smaps_rollup`.
  Clones of one template snapshot map the same file pages, so PSS splits those pages between
  them; RSS would count them once per clone.
- `MemoryManager`: one asyncio task per node. A sandbox nobody talked to for `idle_s` gets its
  balloon inflated towards `floor_mb`; any activity (`note_activity`, called by the proxy)
  deflates it again in the background, so requests never wait for the guest
  (deflate-on-oom covers the guest meanwhile). When the host runs short of memory
  (MemAvailable below `1 - pressure_pct`, or PSI `some avg10` above `psi_avg10`), balloons
  of the idlest sandboxes are inflated first, one per tick, until the pressure is gone.
  `hold(id)` keeps the manager off a sandbox (deflated) while it is captured: a snapshot must
  never carry a balloon target below full into its clones.

Only guests with a balloon are inflated (`VMM.balloon_reclaims`); clones of a template give
memory back through `vmm.ramshim`, which keeps their discards off the template's file.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from agentenv.contract.runtime import HostMemory
from agentenv.vmm.base import VMM
from agentenv.vmm.errors import BalloonUnsupported, VMMError

log = logging.getLogger(__name__)

MIB = 1024 * 1024
# How close to the full size counts as deflated (the guest driver works in 4 KiB pages and
# QEMU reports what the guest acknowledged).
DEFLATED_SLACK = 4 * MIB
DEFLATE_WAIT_S = 15.0
DEFLATE_POLL_S = 0.05


def host_memory(pid: int) -> HostMemory | None:
    """PSS and RSS of one process, or None if it is gone."""
    try:
        text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    except OSError:
        return None
    fields: dict[str, int] = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if len(parts) == 2 and parts[1] == "kB" and parts[0].isdigit():
            fields[key] = int(parts[0]) * 1024
    if "Pss" not in fields:
        return None
    return HostMemory(
        rss=fields.get("Rss", 0),
        pss=fields["Pss"],
        pss_anon=fields.get("Pss_Anon", 0),
        pss_file=fields.get("Pss_File", 0),
        pss_shmem=fields.get("Pss_Shmem", 0),
    )


# How long a QEMU's PSS is taken as it was read. Reading it is a walk of the process's page
# tables (~3 ms of CPU for a 512 MiB clone here); lists, polls of one sandbox and metrics
# scrapes ask for it again within moments.
PSS_FRESH_S = 2.0


class PssCache:
    """`host_memory` of running sandboxes' QEMUs, read in a thread (never on the event loop)
    and kept `PSS_FRESH_S` per sandbox."""

    def __init__(self, fresh_s: float = PSS_FRESH_S) -> None:
        self.fresh_s = fresh_s
        self._seen: dict[str, tuple[int, float, HostMemory | None]] = {}

    async def read(self, sandbox_id: str, pid: int) -> HostMemory | None:
        now = time.monotonic()
        seen = self._seen.get(sandbox_id)
        if seen is not None and seen[0] == pid and now - seen[1] < self.fresh_s:
            return seen[2]
        mem = await asyncio.to_thread(host_memory, pid)
        if len(self._seen) >= 256:
            # Those of sandboxes nobody asked about lately (gone, most of them).
            self._seen = {k: v for k, v in self._seen.items() if now - v[1] < self.fresh_s}
        self._seen[sandbox_id] = (pid, now, mem)
        return mem


@dataclass(frozen=True)
class HostPressure:
    total: int
    available: int
    # PSI `some avg10` of /proc/pressure/memory (percent of time stalled), None without PSI.
    psi_some_avg10: float | None

    @property
    def used_fraction(self) -> float:
        return 1.0 - self.available / self.total if self.total else 0.0


def read_pressure(
    meminfo: Path = Path("/proc/meminfo"), psi: Path = Path("/proc/pressure/memory")
) -> HostPressure:
    values: dict[str, int] = {}
    for line in meminfo.read_text().splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            values[key] = int(parts[0]) * 1024
    avg10: float | None = None
    with contextlib.suppress(OSError):
        for line in psi.read_text().splitlines():
            if line.startswith("some "):
                for word in line.split()[1:]:
                    name, _, value = word.partition("=")
                    if name == "avg10":
                        avg10 = float(value)
    return HostPressure(values.get("MemTotal", 0), values.get("MemAvailable", 0), avg10)


class Guest(Protocol):
    """What the manager needs of a sandbox (`node.host.SandboxHandle` is one)."""

    @property
    def id(self) -> str: ...

    @property
    def memory_mb(self) -> int: ...

    @property
    def paused(self) -> bool: ...

    @property
    def vm(self) -> VMM: ...


@dataclass(frozen=True)
class MemoryPolicy:
    # Inflate after this long without activity (0: never for idleness).
    idle_s: float = 60.0
    # What an inflated guest keeps.
    floor_mb: int = 128
    # Host memory use (1 - MemAvailable/MemTotal) above which idlest guests are inflated
    # (0: no pressure reclaim).
    pressure_pct: float = 80.0
    # PSI `some avg10` above which the host counts as pressured too (0: ignore PSI).
    psi_avg10: float = 10.0
    # Under pressure, guests active more recently than this are left alone.
    pressure_min_idle_s: float = 5.0
    tick_s: float = 1.0


@dataclass
class _State:
    last_activity: float
    # The balloon target last set by the manager, None while the guest has all its memory.
    target: int | None = None
    held: int = 0
    deflating: asyncio.Task[None] | None = None


class MemoryManager:
    def __init__(
        self,
        guests: Callable[[], Iterable[Guest]],
        policy: MemoryPolicy | None = None,
        *,
        pressure: Callable[[], HostPressure] = read_pressure,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.policy = policy or MemoryPolicy()
        self._guests = guests
        self._pressure = pressure
        self._clock = clock
        self._state: dict[str, _State] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._task: asyncio.Task[None] | None = None
        # Counters for tests, logs and the bench.
        self.inflations = 0
        self.deflations = 0

    # -- lifecycle --------------------------------------------------------------------------

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="memory-manager")

    async def close(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for st in self._state.values():
            if st.deflating is not None:
                st.deflating.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await st.deflating

    # -- hooks ------------------------------------------------------------------------------

    def note_activity(self, sandbox_id: str) -> None:
        """Something talked to the sandbox: it is not idle, and an inflated balloon goes
        (in the background: the caller never waits for the guest)."""
        st = self._state.get(sandbox_id)
        now = self._clock()
        if st is None:
            self._state[sandbox_id] = _State(now)
            return
        st.last_activity = now
        if st.target is not None and st.deflating is None:
            guest = self._find(sandbox_id)
            if guest is not None:
                st.deflating = asyncio.create_task(self._deflate_bg(guest, st))

    def forget(self, sandbox_id: str) -> None:
        st = self._state.pop(sandbox_id, None)
        self._locks.pop(sandbox_id, None)
        if st is not None and st.deflating is not None:
            st.deflating.cancel()

    @contextlib.asynccontextmanager
    async def hold(self, sandbox_id: str) -> AsyncIterator[None]:
        """Keep the manager away from a sandbox (for a capture): deflated first, and not
        inflated again until the block ends. Holds nest."""
        st = self._state.setdefault(sandbox_id, _State(self._clock()))
        st.held += 1
        try:
            guest = self._find(sandbox_id)
            if guest is not None:
                async with self._lock(sandbox_id):
                    await self._deflate(guest, st, wait=True)
            yield
        finally:
            st.held -= 1
            st.last_activity = self._clock()

    def balloon_target(self, sandbox_id: str) -> int | None:
        """The target the manager set for this sandbox, None when deflated."""
        st = self._state.get(sandbox_id)
        return None if st is None else st.target

    # -- the loop ---------------------------------------------------------------------------

    async def _run(self) -> None:
        while True:
            try:
                await self.tick()
            except Exception:
                log.exception("memory manager tick failed")
            await asyncio.sleep(self.policy.tick_s)

    async def tick(self) -> None:
        """One pass: inflate idle guests, then (under host pressure) the idlest one."""
        now = self._clock()
        guests = [g for g in self._guests() if not g.paused]
        live = {g.id for g in guests}
        for gone in [sid for sid in self._state if sid not in live]:
            if self._state[gone].held == 0:
                self.forget(gone)
        candidates: list[tuple[float, Guest, _State]] = []
        for g in guests:
            st = self._state.setdefault(g.id, _State(now))
            if st.held or st.target is not None or st.deflating is not None:
                continue
            if g.memory_mb <= self.policy.floor_mb or not g.vm.balloon_reclaims:
                continue
            candidates.append((st.last_activity, g, st))
        candidates.sort(key=lambda c: c[0])
        p = self.policy
        if p.idle_s > 0:
            for last, g, st in candidates:
                if now - last >= p.idle_s:
                    await self._inflate(g, st, "idle")
        if p.pressure_pct > 0:
            ready = [
                (g, st)
                for last, g, st in candidates
                if st.target is None and now - last >= p.pressure_min_idle_s
            ]
            # The host's pressure is read only when a guest could give memory back: reading
            # /proc/meminfo every tick was most of an idle server's CPU (#23).
            if ready and self._pressured():
                g, st = ready[0]
                await self._inflate(g, st, "host pressure")

    def _pressured(self) -> bool:
        p = self.policy
        try:
            hp = self._pressure()
        except OSError:
            return False
        if hp.used_fraction * 100.0 >= p.pressure_pct:
            return True
        return p.psi_avg10 > 0 and hp.psi_some_avg10 is not None and hp.psi_some_avg10 > p.psi_avg10

    # -- balloon moves ----------------------------------------------------------------------

    def _find(self, sandbox_id: str) -> Guest | None:
        for g in self._guests():
            if g.id == sandbox_id and not g.paused:
                return g
        return None

    def _lock(self, sandbox_id: str) -> asyncio.Lock:
        return self._locks.setdefault(sandbox_id, asyncio.Lock())

    async def _inflate(self, g: Guest, st: _State, why: str) -> None:
        lock = self._lock(g.id)
        if lock.locked():
            return
        async with lock:
            if st.held or st.target is not None:
                return
            target = self.policy.floor_mb * MIB
            try:
                await g.vm.balloon_set(target)
            except VMMError as exc:
                log.info("sandbox %s: no balloon inflation (%s)", g.id, exc)
                return
            st.target = target
            self.inflations += 1
            log.info("sandbox %s: balloon inflated to %d MiB (%s)", g.id, target // MIB, why)

    async def _deflate_bg(self, g: Guest, st: _State) -> None:
        try:
            async with self._lock(g.id):
                await self._deflate(g, st, wait=False)
        except VMMError as exc:
            log.info("sandbox %s: deflate failed (%s)", g.id, exc)
        finally:
            st.deflating = None

    async def _deflate(self, g: Guest, st: _State, *, wait: bool) -> None:
        """Back to full memory. `wait`: also when the manager did not inflate it (a guest
        resumed with its balloon up), and until the guest got there."""
        full = g.memory_mb * MIB
        if st.target is None:
            if not wait:
                return
            try:
                if await g.vm.balloon_query() >= full - DEFLATED_SLACK:
                    return
            except BalloonUnsupported:
                return
        await g.vm.balloon_set(full)
        st.target = None
        self.deflations += 1
        log.info("sandbox %s: balloon deflated", g.id)
        if wait:
            await wait_deflated(g.vm, full)


async def wait_deflated(vm: VMM, full: int, timeout_s: float = DEFLATE_WAIT_S) -> None:
    """Until the guest holds (nearly) all its memory again; bounded."""
    deadline = time.monotonic() + timeout_s
    while True:
        actual = await vm.balloon_query()
        if actual >= full - DEFLATED_SLACK:
            return
        if time.monotonic() > deadline:
            raise VMMError(f"balloon still at {actual // MIB} MiB after {timeout_s:.0f}s")
        await asyncio.sleep(DEFLATE_POLL_S)
