"""Admission control: whether this node starts one more sandbox now, and in which order.

Every start (`Node.create`, a create from a named snapshot, `resume`, `fork` of N children)
runs inside ``async with node.admission.start(what, memory_mb, count=N)``:

1. Capacity, checked against the running sandboxes plus every start already admitted
   (waiting or starting): the sandbox count (`max_sandboxes`), network slots
   (`settings.network.max_slots`), host memory and the data dir's free space. A start that
   does not fit waits for capacity up to `capacity_wait_s` (a burst of creates queues while
   earlier sandboxes end, instead of failing at once), in arrival order: while one waits,
   later starts queue behind it even if they would fit, so a big start is not starved by
   small ones. Past the wait, or for a full disk (which a sandbox ending rarely frees), it
   raises `NoCapacity` (resource, numbers, a retry hint) before the node has allocated
   anything. At most `CAPACITY_QUEUE` starts wait for capacity at once.
2. A start slot: at most `max_starts` run at once; later ones wait in a FIFO of tickets (a
   release hands its slot straight to the oldest waiter, so a late arrival never overtakes),
   at most `start_queue` long, else `NoCapacity` for the queue. A cancelled waiter leaves
   the queue (and passes on a slot it was just handed).

The reservation and the start slot are released when the body ends, however it ends; by then
a start that succeeded is one of the node's running sandboxes.

Memory: a sandbox may use its `memory_mb` plus the VMM's own share (`OVERHEAD_MB`). What its
QEMU already holds privately (RssAnon + RssShmem) is already out of MemAvailable, so the rest
is what it may still grow into. A start fits if MemAvailable, minus that growth of every
running and admitted sandbox, minus `min_free_memory_mb`, leaves its full size. Guest RAM
still mapped from a template snapshot's file (shared page cache) counts as growth until the
guest writes it, which is the conservative side.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import math
import os
import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Protocol

from agentenv.config import Settings
from agentenv.node.errors import NoCapacity
from agentenv.vmm.accel import AccelChoice

log = logging.getLogger(__name__)

MIB = 1024 * 1024
# What a QEMU holds besides guest RAM, for accounting: measured ~47 MiB RssAnon for a fresh
# TCG clone (QEMU heap, device state, the guest pages it wrote), plus up to 64 MiB of TCG code
# cache; a larger cache (`Settings.tcg_tb_size_mb`) adds the rest (`Limits.for_accel`). The
# cgroup ceiling (`vmm.qemu.memory_overhead_mb`) is the hard limit; this is the expected worst
# case, so 32 sandboxes of 512 MB (20 GiB) fit a 24 GiB host with the 64 MiB cache.
OVERHEAD_MB = 128
# Retry hints (seconds): a sandbox must end before memory, slots or the count free up.
RETRY_CAPACITY_S = 10
RETRY_DISK_S = 60
# Start duration assumed before one was measured (a restore under TCG is ~1 s).
FIRST_START_S = 2.0
# How often the start at the head of the capacity queue checks again without an event: host
# memory frees up without one (a guest's balloon, page cache); a sandbox ending or a start
# finishing wakes it at once (`notify`).
CAPACITY_POLL_S = 0.5
# What a sandbox ending frees; a full disk is refused at once.
WAITABLE = frozenset({"sandboxes", "network slots", "memory"})
# How old a running sandbox's held memory (`private_bytes`) may be when a check counts it:
# reading it is ~40 µs per running VM, on the event loop, in every check (each create, each
# published load), so a burst of creates on a node of hundreds of sandboxes read them all for
# each one (#23). Within this window a VM that grew is counted as still able to grow (the fresh
# MemAvailable already shows what it took: a check errs on the safe side); one whose memory a
# balloon took back is counted as holding it, at most this long.
HELD_FRESH_S = 0.5
# Starts that may wait for capacity at once: a waiter is one coroutine and its request, so
# this is far above the start queue (which holds starts about to spend CPU).
CAPACITY_QUEUE = 1024


class Running(Protocol):
    """A running sandbox as admission sees it (`node.host.SandboxHandle` is one)."""

    @property
    def memory_mb(self) -> int: ...

    @property
    def pid(self) -> int | None: ...


# What `headroom` reports as the slots left of a node with no count or slot limit.
UNLIMITED_SLOTS = 1 << 16


@dataclass(frozen=True)
class Limits:
    max_sandboxes: int = 0  # 0: no count limit
    max_starts: int = 2
    queue: int = 128
    capacity_wait_s: float = 0.0  # 0: refuse at once when a start does not fit
    max_slots: int = 0  # 0: no slot limit
    min_free_memory_mb: int = 256
    min_free_disk_mb: int = 1024
    overhead_mb: int = OVERHEAD_MB

    @classmethod
    def from_settings(cls, s: Settings) -> Limits:
        return cls(
            max_sandboxes=s.max_sandboxes,
            max_starts=s.max_starts,
            queue=s.start_queue,
            capacity_wait_s=s.capacity_wait_s,
            max_slots=s.network.max_slots,
            min_free_memory_mb=s.min_free_memory_mb,
            min_free_disk_mb=s.min_free_disk_mb,
        )

    def for_accel(self, accel: AccelChoice) -> Limits:
        """These limits with the overhead of a VM of the chosen accelerator (its code cache
        beyond the 64 MiB `OVERHEAD_MB` counts; none on KVM)."""
        return replace(self, overhead_mb=OVERHEAD_MB + accel.code_cache_extra_mb)


def mem_available() -> int:
    """MemAvailable of /proc/meminfo, in bytes."""
    with open("/proc/meminfo") as fh:
        for line in fh:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise OSError("no MemAvailable in /proc/meminfo")


def private_bytes(pid: int) -> int:
    """What process `pid` holds that no other process shares (RssAnon + RssShmem), 0 if
    it is gone."""
    try:
        with open(f"/proc/{pid}/status", "rb") as fh:
            status = fh.read()
    except OSError:
        return 0
    total = 0
    for field in (b"\nRssAnon:", b"\nRssShmem:"):
        at = status.find(field)
        if at >= 0:
            start = at + len(field)
            total += int(status[start : status.index(b"kB", start)]) * 1024
    return total


def disk_free(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


@dataclass(eq=False)
class _Reservation:
    count: int
    memory_mb: int


class Admission:
    def __init__(
        self,
        limits: Limits,
        running: Callable[[], Iterable[Running]],
        data_dir: Path,
        *,
        available: Callable[[], int] = mem_available,
        held: Callable[[int], int] = private_bytes,
        free_disk: Callable[[Path], int] = disk_free,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.limits = limits
        self._running = running
        self.data_dir = data_dir
        self._available = available
        self._held = held
        self._free_disk = free_disk
        self._clock = clock
        # pid -> (the sandbox, when read, bytes held): `_growth`'s reads, each reused for
        # HELD_FRESH_S while that pid is still that sandbox's.
        self._held_seen: dict[int, tuple[Running, float, int]] = {}
        self._reserved: list[_Reservation] = []
        self._active = 0
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self._start_s = FIRST_START_S
        # Starts waiting for capacity, oldest first, and the event that wakes them.
        self._capacity_queue: collections.deque[object] = collections.deque()
        self._changed = asyncio.Event()

    # -- what tests and metrics see ------------------------------------------------------------

    @property
    def starting(self) -> int:
        """Starts holding a start slot."""
        return self._active

    @property
    def waiting(self) -> int:
        """Starts queued for a start slot."""
        return sum(1 for f in self._waiters if not f.done())

    @property
    def waiting_for_capacity(self) -> int:
        """Starts queued because they do not fit yet."""
        return len(self._capacity_queue)

    @property
    def reserved(self) -> int:
        """Sandboxes admitted and not yet done starting (waiting or starting)."""
        return sum(r.count for r in self._reserved)

    # -- the gate ------------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def start(
        self, what: str, memory_mb: int, count: int = 1, *, wait_s: float | None = None
    ) -> AsyncIterator[None]:
        """Admit `count` sandboxes of `memory_mb` for the body, waiting up to `wait_s`
        (default `limits.capacity_wait_s`) for them to fit, then in arrival order for a start
        slot; `NoCapacity` if they do not fit in time or a queue is full."""
        res = await self._reserve(
            what, memory_mb, count, self.limits.capacity_wait_s if wait_s is None else wait_s
        )
        try:
            must_wait = self._active >= self.limits.max_starts or self.waiting > 0
            if must_wait and self.waiting >= self.limits.queue:
                raise NoCapacity(
                    f"no capacity: start queue full: {self.waiting} starts waiting behind "
                    f"{self._active} running (AGENTENV_START_QUEUE={self.limits.queue}, "
                    f"AGENTENV_MAX_STARTS={self.limits.max_starts}); {what} was not queued",
                    resource="start queue",
                    retry_after_s=self._drain_s(),
                )
            await self._enter(must_wait)
            t0 = time.monotonic()
            try:
                yield
            finally:
                self._leave()
            # Only successful starts say how long a start takes.
            self._start_s = 0.8 * self._start_s + 0.2 * (time.monotonic() - t0)
        finally:
            self._reserved.remove(res)
            # A start that failed frees what it held; one that succeeded turned it into a
            # running sandbox's, which changes the memory sums too.
            self.notify()

    @contextlib.contextmanager
    def kept(self, memory_mb: int) -> Iterator[None]:
        """A running sandbox's place, kept while it is out of the running list (a reset
        swaps its QEMU): counted as reserved, not checked or queued (it had the place), so
        no start takes it meanwhile."""
        res = self._take(1, memory_mb)
        try:
            yield
        finally:
            self._reserved.remove(res)
            self.notify()

    def notify(self) -> None:
        """Capacity may have changed (a sandbox ended, a start finished): the start at the
        head of the capacity queue checks again now."""
        self._changed.set()
        self._changed = asyncio.Event()

    async def _reserve(self, what: str, memory_mb: int, count: int, wait_s: float) -> _Reservation:
        """Check and take the reservation with no await in between, so two starts never both
        count the same free capacity."""
        if not self._capacity_queue or wait_s <= 0:
            try:
                self._check(what, memory_mb, count)
            except NoCapacity as exc:
                if wait_s <= 0 or exc.resource not in WAITABLE:
                    raise
            else:
                return self._take(count, memory_mb)
        if len(self._capacity_queue) >= CAPACITY_QUEUE:
            raise NoCapacity(
                f"no capacity: {len(self._capacity_queue)} starts already wait for capacity; "
                f"{what} was not queued",
                resource="capacity queue",
                retry_after_s=RETRY_CAPACITY_S,
            )
        me = object()
        self._capacity_queue.append(me)
        log.info(
            "%s waits for capacity (up to %.0fs, %d ahead)",
            what,
            wait_s,
            len(self._capacity_queue) - 1,
        )
        deadline = time.monotonic() + wait_s
        refusal: NoCapacity | None = None
        try:
            while True:
                changed = self._changed
                if self._capacity_queue[0] is me:
                    try:
                        self._check(what, memory_mb, count)
                    except NoCapacity as exc:
                        if exc.resource not in WAITABLE:
                            raise
                        refusal = exc
                    else:
                        return self._take(count, memory_mb)
                left = deadline - time.monotonic()
                if left <= 0:
                    reason = str(refusal) if refusal else "the starts ahead still wait"
                    raise NoCapacity(
                        f"{reason}; waited {wait_s:.0f}s for capacity (AGENTENV_CAPACITY_WAIT_S)",
                        resource=refusal.resource if refusal else "capacity queue",
                        retry_after_s=RETRY_CAPACITY_S,
                    )
                # Only the head polls; the rest wait for it to leave (or their deadline).
                poll = CAPACITY_POLL_S if self._capacity_queue[0] is me else left
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(min(poll, left)):
                        await changed.wait()
        finally:
            head = self._capacity_queue[0] is me
            self._capacity_queue.remove(me)
            if head:
                self.notify()

    def _take(self, count: int, memory_mb: int) -> _Reservation:
        res = _Reservation(count, memory_mb)
        self._reserved.append(res)
        return res

    async def _enter(self, must_wait: bool) -> None:
        if not must_wait:
            self._active += 1
            return
        ticket: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(ticket)
        try:
            await ticket
        except BaseException:
            if ticket.done() and not ticket.cancelled():
                # Handed the slot as we were cancelled: pass it on.
                self._leave()
            else:
                with contextlib.suppress(ValueError):
                    self._waiters.remove(ticket)
            raise

    def _leave(self) -> None:
        """Give this start slot to the oldest waiter, or free it."""
        while self._waiters:
            ticket = self._waiters.popleft()
            if not ticket.done():
                ticket.set_result(None)
                return
        self._active -= 1

    def _drain_s(self) -> int:
        """How long the queue as it is takes to start."""
        ahead = self.waiting + self._active
        return max(1, math.ceil(self._start_s * ahead / self.limits.max_starts))

    # -- capacity ------------------------------------------------------------------------------

    def headroom(self) -> tuple[int, int]:
        """(MiB a new sandbox could still have, network slots left) as `_check` counts them:
        what a cluster's placement compares nodes by."""
        lim = self.limits
        running = list(self._running())
        in_use = len(running) + self.reserved
        caps = [c for c in (lim.max_slots, lim.max_sandboxes) if c]
        slots = max(0, min(caps) - in_use) if caps else UNLIMITED_SLOTS
        try:
            available = self._available()
        except OSError:
            return 0, slots
        left = available - self._growth(running) - lim.min_free_memory_mb * MIB
        return max(0, left) // MIB, slots

    def _check(self, what: str, memory_mb: int, count: int) -> None:
        lim = self.limits
        running = list(self._running())
        in_use = len(running) + self.reserved
        if lim.max_sandboxes and in_use + count > lim.max_sandboxes:
            raise NoCapacity(
                f"no capacity: {in_use} of {lim.max_sandboxes} sandboxes in use (running or "
                f"starting, AGENTENV_MAX_SANDBOXES); {what} needs {count} more",
                resource="sandboxes",
                retry_after_s=RETRY_CAPACITY_S,
            )
        if lim.max_slots and in_use + count > lim.max_slots:
            raise NoCapacity(
                f"no capacity: {in_use} of {lim.max_slots} network slots in use; {what} "
                f"needs {count} more",
                resource="network slots",
                retry_after_s=RETRY_CAPACITY_S,
            )
        self._check_memory(what, memory_mb, count, running)
        self._check_disk(what)

    def _check_memory(self, what: str, memory_mb: int, count: int, running: list[Running]) -> None:
        lim = self.limits
        try:
            available = self._available()
        except OSError:
            return
        growth = self._growth(running)
        need = count * (memory_mb + lim.overhead_mb) * MIB
        left = available - growth - lim.min_free_memory_mb * MIB
        if need > left:
            others = len(running) + self.reserved
            raise NoCapacity(
                f"no capacity: host memory: {what} needs {need // MIB} MiB ({count} x "
                f"{memory_mb} MB + {lim.overhead_mb} MiB VMM overhead), "
                f"{max(0, left) // MIB} MiB left: {available // MIB} MiB available, "
                f"{growth // MIB} MiB of it for {others} running or starting sandboxes "
                f"to grow into, {lim.min_free_memory_mb} MiB kept free "
                "(AGENTENV_MIN_FREE_MEMORY_MB)",
                resource="memory",
                retry_after_s=RETRY_CAPACITY_S,
            )

    def _growth(self, running: list[Running]) -> int:
        """What the running sandboxes may still grow into (each up to its memory and the
        overhead, less what it holds now), and what admitted starts will take in full."""
        lim = self.limits
        now = self._clock()
        seen: dict[int, tuple[Running, float, int]] = {}
        growth = 0
        for sb in running:
            held = 0
            if sb.pid is not None:
                was, at, held = self._held_seen.get(sb.pid, (sb, -math.inf, 0))
                # An ended VM's pid may come back as another's: only the same sandbox's.
                if was is not sb or now - at >= HELD_FRESH_S:
                    at, held = now, self._held(sb.pid)
                seen[sb.pid] = (sb, at, held)
            growth += max(0, (sb.memory_mb + lim.overhead_mb) * MIB - held)
        self._held_seen = seen
        growth += sum(r.count * (r.memory_mb + lim.overhead_mb) * MIB for r in self._reserved)
        return growth

    def _check_disk(self, what: str) -> None:
        lim = self.limits
        try:
            free = self._free_disk(self.data_dir)
        except OSError:
            return
        if free < lim.min_free_disk_mb * MIB:
            raise NoCapacity(
                f"no capacity: disk: {free // MIB} MiB free in the data dir {self.data_dir}, "
                f"below the {lim.min_free_disk_mb} MiB minimum (AGENTENV_MIN_FREE_DISK_MB); "
                f"{what} was refused",
                resource="disk",
                retry_after_s=RETRY_DISK_S,
            )
