"""Warm pools: restores prepared ahead of time (slot taken, disk upper made, QEMU spawned with
`-incoming defer`), so a create only loads the state and gives the guest its identity.

Pools are per shape (template, cpu, memory) and only for shapes used recently: a shape joins
when a create asks for it and leaves, its entries dropped, after `idle_s` without one. A
named snapshot is a shape too (`snapshot_shape`), joining at its second create within
`idle_s`: RL episodes create from one task state over and over, a one-off create from a
snapshot should not leave QEMUs waiting behind it. `max_entries` caps the entries of all
shapes together (each is a QEMU and a network slot): at the cap, a shape below `low` takes
an entry from the shape used longest ago, else it waits. Each
entry is tied to the snapshot id it was prepared from; a rebuilt template snapshot makes older
entries stale, and they are discarded instead of handed out. A periodic check also drops the
entries of a shape whose template snapshot changed or went away, so nobody has to create
from it for them (and the old snapshot they keep mapped) to go.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from agentenv.snapshot.restore import Prepared

log = logging.getLogger(__name__)

# A shape nobody created for this long leaves the pool and its entries are dropped.
IDLE_S = 600.0
# How often idle shapes and entries of a changed or deleted template snapshot are looked for.
CHECK_S = 5.0
# After a failed prepare, the refill waits this long before trying that shape again.
RETRY_S = 5.0


@dataclass(frozen=True)
class Shape:
    template: str
    cpu: int
    memory_mb: int


# A shape's `template` for creates from a named snapshot: the name (or id) they give, so a
# name that moves to another snapshot makes the entries stale, as a rebuilt template does.
SNAPSHOT_PREFIX = "snapshot:"


def snapshot_shape(ref: str, cpu: int, memory_mb: int) -> Shape:
    return Shape(SNAPSHOT_PREFIX + ref, cpu, memory_mb)


@dataclass
class _Entries:
    snapshot_id: str
    used_at: float
    ready: list[Prepared] = field(default_factory=list)
    failed_at: float = -RETRY_S
    filling: bool = True


class WarmPool:
    """`make(snapshot_id)` prepares one guest (its sandbox id is `Prepared.name`);
    `drop(prepared)` undoes it, slot and workdir included; `current(shape)` is the snapshot id
    a create of that shape would restore now (None: none, or the template is gone)."""

    def __init__(
        self,
        low: int,
        high: int,
        make: Callable[[str], Awaitable[Prepared]],
        drop: Callable[[Prepared], Coroutine[Any, Any, None]],
        current: Callable[[Shape], Awaitable[str | None]] | None = None,
        idle_s: float = IDLE_S,
        check_s: float = CHECK_S,
        max_entries: int | None = None,
    ) -> None:
        self.low, self.high, self.idle_s, self.check_s = low, high, idle_s, check_s
        self.max_entries = max_entries
        self._make, self._drop, self._current = make, drop, current
        self._shapes: dict[Shape, _Entries] = {}
        # Shapes asked for once that join at their next ask (`take(..., repeated=True)`).
        self._asked: dict[Shape, float] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._drops: set[asyncio.Task[None]] = set()
        self.taken = 0
        self.discarded = 0

    @property
    def enabled(self) -> bool:
        return self.high > 0

    def start(self) -> None:
        if self.enabled and self._task is None:
            self._task = asyncio.create_task(self._refill_loop(), name="warm-pool")

    def ready(self, shape: Shape) -> list[Prepared]:
        entries = self._shapes.get(shape)
        return list(entries.ready) if entries is not None else []

    def take(self, shape: Shape, snapshot_id: str, *, repeated: bool = False) -> Prepared | None:
        """A live entry prepared from `snapshot_id`, or None. Marks the shape as used (it
        joins the pool if new: at once, or with `repeated` at its second ask within
        `idle_s`) and wakes the refill; stale or dead entries are dropped."""
        if not self.enabled:
            return None
        entries = self._shapes.get(shape)
        now = time.monotonic()
        if entries is None:
            if repeated and now - self._asked.pop(shape, -self.idle_s) > self.idle_s:
                self._asked[shape] = now
                return None
            entries = self._shapes[shape] = _Entries(snapshot_id, now)
        entries.used_at = now
        stale: list[Prepared] = []
        if entries.snapshot_id != snapshot_id:
            stale, entries.ready = entries.ready, []
            entries.snapshot_id = snapshot_id
        found: Prepared | None = None
        while entries.ready and found is None:
            prep = entries.ready.pop(0)
            if prep.vm.exit_code is None and prep.vm.pid is not None:
                found = prep
            else:
                stale.append(prep)
        for prep in stale:
            self._discard(prep)
        if found is not None:
            self.taken += 1
        self._wake.set()
        return found

    def evict(self, name: str) -> bool:
        """Drop the ready entry `name` (its QEMU died) and refill; False if it is none."""
        for entries in self._shapes.values():
            for prep in entries.ready:
                if prep.name == name:
                    entries.ready.remove(prep)
                    self._discard(prep)
                    self._wake.set()
                    return True
        return False

    def _discard(self, prep: Prepared) -> None:
        self.discarded += 1
        log.info("warm %s from %s discarded", prep.name, prep.snap.id[:12])
        # Dropping kills a process and removes files; the caller must not wait for it.
        task = asyncio.create_task(self._drop(prep), name=f"warm-drop-{prep.name}")
        self._drops.add(task)
        task.add_done_callback(self._drops.discard)
        task.add_done_callback(_log_failure)

    def shapes(self) -> list[Shape]:
        return list(self._shapes)

    def _count(self) -> int:
        return sum(len(e.ready) for e in self._shapes.values())

    def _make_room(self, shape: Shape, entries: _Entries) -> bool:
        """At the cap: an entry for `shape` if it is below `low`, taken from the shape used
        longest ago (and not since `shape` was); False when there is none to take."""
        if len(entries.ready) >= self.low:
            return False
        others = [
            (e.used_at, str(s), s)
            for s, e in self._shapes.items()
            if s != shape and e.ready and e.used_at < entries.used_at
        ]
        if not others:
            return False
        victim = self._shapes[min(others)[2]]
        self._discard(victim.ready.pop())
        return True

    async def _refill_loop(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.check_s):
                    await self._wake.wait()
            self._wake.clear()
            try:
                await self._check()
            except Exception:
                log.exception("warm pool check failed")
            while await self._refill_one():
                pass

    async def _check(self) -> None:
        """Drop idle shapes, and entries whose template snapshot is no longer the one a
        create would restore."""
        now = time.monotonic()
        self._asked = {s: t for s, t in self._asked.items() if now - t <= self.idle_s}
        for shape, entries in list(self._shapes.items()):
            current: str | None = None
            idle = time.monotonic() - entries.used_at > self.idle_s
            if not idle:
                current = entries.snapshot_id
                if self._current is not None:
                    current = await self._current(shape)
            # A create may have replaced the entries while `current` was looked up.
            if current == entries.snapshot_id or self._shapes.get(shape) is not entries:
                continue
            stale, entries.ready = entries.ready, []
            for prep in stale:
                self._discard(prep)
            if current is None:
                why = "idle" if idle else "template snapshot gone"
                log.info("warm pool for %s closed (%s), %d dropped", shape, why, len(stale))
                del self._shapes[shape]
            else:
                entries.snapshot_id = current

    async def _refill_one(self) -> bool:
        """Prepare one entry for the neediest shape; False when none needs one."""
        now = time.monotonic()
        for shape, entries in list(self._shapes.items()):
            if now - entries.used_at > self.idle_s or now - entries.failed_at < RETRY_S:
                continue
            # Falling below `low` starts a refill that goes on up to `high`.
            if len(entries.ready) < self.low:
                entries.filling = True
            if len(entries.ready) >= self.high:
                entries.filling = False
            if not entries.filling:
                continue
            full = self.max_entries is not None and self._count() >= self.max_entries
            if full and not self._make_room(shape, entries):
                continue
            snapshot_id = entries.snapshot_id
            try:
                prep = await self._make(snapshot_id)
            except Exception as exc:
                log.warning("warm pool for %s: prepare failed: %s", shape, exc)
                entries.failed_at = time.monotonic()
                loop = asyncio.get_running_loop()
                loop.call_later(RETRY_S, self._wake.set)
                continue
            current = self._shapes.get(shape)
            if current is None or current.snapshot_id != snapshot_id:
                self._discard(prep)
            else:
                current.ready.append(prep)
                log.info("warm %s ready for %s", prep.name, shape)
            return True
        return False

    async def close(self) -> None:
        """Stop refilling and drop every entry."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._drops:
            await asyncio.gather(*self._drops, return_exceptions=True)
        for entries in self._shapes.values():
            for prep in entries.ready:
                try:
                    await self._drop(prep)
                except Exception:
                    log.exception("dropping warm %s", prep.name)
            entries.ready = []
        self._shapes.clear()


def _log_failure(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("dropping a warm entry failed: %s", task.exception())
