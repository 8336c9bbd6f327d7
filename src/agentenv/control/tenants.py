"""Per-team limits: how many sandboxes a team may hold at once and how fast it may create.

A team's limits are its `teams` row (`Store.team`), read at every check, so `aenv teams
set-limits` run in another process applies from the next request on. 0 means no limit of
the team's own; the node's admission limits (`node.admission`) apply either way.

- Concurrency: the team's sandboxes that hold a VM or are about to (`store.ACTIVE_STATES`;
  paused ones are disk only, build sandboxes are the server's) plus those asked for must fit
  `max_sandboxes`. Checked on create, fork and every resume (connect, the proxy's
  auto-resume). `reserve` checks under a per-team lock and holds the place until the
  caller's row that takes it is in the store, so two requests cannot both take the last
  place. Replicas sharing a store (`SharedPlaces`: etcd) hold places in the store, under
  the replica's lease (a replica that dies mid-create leaves no hold behind), so the limit
  is exact across replicas too.
- Create rate: a token bucket per team holding up to `creates_per_minute` tokens, refilled
  continuously at that rate (a full minute's allowance may come as one burst); a create
  takes one, a fork one per child. On one server buckets are in memory (a restart refills
  them); replicas sharing a store (`SharedBuckets`: etcd) take from one bucket per team in
  the store, so N replicas do not allow N times the rate.

Both refusals are `TooManyRequests` (429) with a Retry-After: for the rate, when enough
tokens are back; for concurrency, when the team's soonest sandbox timeout passes (bounded
to 1..30 s, a hint only: a kill frees a place sooner).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import secrets
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import NoReturn, Protocol, runtime_checkable

from agentenv.contract.errors import TooManyRequests
from agentenv.control.store import Store, Team

MAX_CONCURRENCY_RETRY_S = 30
# A shared hold the store did not take back at the end of its create is given back again
# after each of these pauses (about 15 minutes in all); it must neither fail the create that
# is done nor keep the team's place for as long as this replica lives.
RELEASE_RETRY_S = (0.5, 1, 2, 5, 10, 30, 60, 60, 120, 120, 120, 120, 120, 120)

log = logging.getLogger(__name__)


@runtime_checkable
class SharedBuckets(Protocol):
    """A store whose replicas share each team's create-rate bucket."""

    async def take_tokens(self, team_id: str, count: int, rate: int, now: float) -> int | None:
        """Takes `count` tokens of a bucket of `rate` per minute (full when new) at wall time
        `now`; None when taken, else the seconds until there are enough (nothing taken)."""
        ...


@runtime_checkable
class SharedPlaces(Protocol):
    """A store whose replicas hold each team's concurrency places in one place."""

    async def take_places(
        self, team_id: str, count: int, limit: int, hold_id: str, lease: int
    ) -> float | None:
        """Holds `count` places of `limit` as `hold_id` (under etcd lease `lease`); None when
        held, else the soonest end of the team's sandboxes (0 if none) and nothing held."""
        ...

    async def release_places(self, team_id: str, hold_id: str) -> None: ...


@dataclass
class _Bucket:
    tokens: float
    at: float


class TeamLimits:
    def __init__(
        self,
        store: Store,
        clock: Callable[[], float] | None = None,
        *,
        lease: Callable[[], int] | None = None,
    ) -> None:
        """`lease`: this replica's current etcd lease, under which places are held in a
        shared store (`SharedPlaces`); without it places are held in this process only."""
        self.store = store
        self._lease = lease
        self._clock = clock or time.monotonic
        # A shared bucket is refilled by wall time: every replica reads the same clock.
        self._wall = clock or time.time
        self._buckets: dict[str, _Bucket] = {}
        # Places taken by admitted requests whose rows are not in the store yet (a fork's
        # children exist only after the runtime made them).
        self._held: dict[str, int] = {}
        # One per team: a check and the hold it grants are one step.
        self._locks: dict[str, asyncio.Lock] = {}
        self.release_retry_s: tuple[float, ...] = RELEASE_RETRY_S
        self._retries: set[asyncio.Task[None]] = set()

    @contextlib.asynccontextmanager
    async def reserve(
        self, team_id: str, count: int = 1, *, create: bool = True
    ) -> AsyncIterator[None]:
        """`admit` `count` sandboxes and count them as the team's until the block ends (by
        then their rows are in the store, or they failed). The check and the hold happen
        under the team's lock: a concurrent request sees the place as taken."""
        hold_id: str | None = None
        async with self._lock(team_id):
            hold_id = await self._admit(team_id, count, create, hold=True)
            if hold_id is None:
                self._held[team_id] = self._held.get(team_id, 0) + count
        try:
            yield
        finally:
            if hold_id is not None:
                # Shielded: the caller's row is in (or failed) and the place must go either way.
                await asyncio.shield(self._release(team_id, hold_id))
            else:
                left = self._held.get(team_id, 0) - count
                if left > 0:
                    self._held[team_id] = left
                else:
                    self._held.pop(team_id, None)

    async def admit(self, team_id: str, count: int = 1, *, create: bool = True) -> None:
        """Raise `TooManyRequests` unless `count` more sandboxes of `team_id` fit; `create`:
        they are new (a create or fork, which the rate limit counts), not a resume. Holds
        nothing: `reserve` is what a caller that goes on to take the place uses."""
        async with self._lock(team_id):
            await self._admit(team_id, count, create)

    def _lock(self, team_id: str) -> asyncio.Lock:
        return self._locks.setdefault(team_id, asyncio.Lock())

    async def _admit(
        self, team_id: str, count: int, create: bool, *, hold: bool = False
    ) -> str | None:
        """The id of the places held in a shared store (with `hold`), else None."""
        team = await self.store.team(team_id)
        if team is None:
            return None
        hold_id = await self._check_concurrency(team, count, hold)
        if create:
            try:
                await self._take(team, count)
            except BaseException:
                if hold_id is not None:
                    await asyncio.shield(self._release(team.id, hold_id))
                raise
        return hold_id

    async def _release(self, team_id: str, hold_id: str) -> None:
        """Gives a shared hold back; if the store fails now, again in the background."""
        assert isinstance(self.store, SharedPlaces)
        try:
            await self.store.release_places(team_id, hold_id)
        except Exception as exc:
            log.warning("team %s: hold %s not given back yet (%s); trying again",
                        team_id, hold_id, exc)  # fmt: skip
            task = asyncio.get_running_loop().create_task(self._release_later(team_id, hold_id))
            self._retries.add(task)
            task.add_done_callback(self._retries.discard)

    async def _release_later(self, team_id: str, hold_id: str) -> None:
        assert isinstance(self.store, SharedPlaces)
        last: Exception | None = None
        for pause in self.release_retry_s:
            await asyncio.sleep(pause)
            try:
                await self.store.release_places(team_id, hold_id)
                return
            except Exception as exc:
                last = exc
        log.error("team %s: hold %s could not be given back (%s); it goes with this "
                  "replica's lease", team_id, hold_id, last)  # fmt: skip

    async def close(self) -> None:
        """Ends the background give-backs (their holds go with this replica's lease)."""
        for task in list(self._retries):
            task.cancel()
        await asyncio.gather(*self._retries, return_exceptions=True)

    def _shared(self) -> bool:
        # Lease 0 (not registered): a hold would outlive a crash, so none is made.
        return (
            self._lease is not None and isinstance(self.store, SharedPlaces) and self._lease() != 0
        )

    async def _check_concurrency(self, team: Team, count: int, hold: bool) -> str | None:
        limit = team.max_sandboxes
        if limit <= 0:
            return None
        if self._shared() and hold:
            assert self._lease is not None and isinstance(self.store, SharedPlaces)
            hold_id = secrets.token_hex(8)
            ends = await self.store.take_places(team.id, count, limit, hold_id, self._lease())
            if ends is None:
                return hold_id
            self._refuse(team, ends or None)
        if self._shared():
            # A check only (`admit`): the same transaction, its hold given back at once.
            assert self._lease is not None and isinstance(self.store, SharedPlaces)
            hold_id = secrets.token_hex(8)
            ends = await self.store.take_places(team.id, count, limit, hold_id, self._lease())
            if ends is not None:
                self._refuse(team, ends or None)
            await self._release(team.id, hold_id)
            return None
        active, soonest = await self.store.count_active(team.id)
        if active + self._held.get(team.id, 0) + count <= limit:
            return None
        self._refuse(team, soonest)

    def _refuse(self, team: Team, soonest: float | None) -> NoReturn:
        limit = team.max_sandboxes
        wait = 1
        if soonest is not None:
            wait = min(max(1, math.ceil(soonest - time.time())), MAX_CONCURRENCY_RETRY_S)
        raise TooManyRequests(
            f"you have reached the maximum number of concurrent sandboxes ({limit}) of team "
            f"'{team.name}'; kill or pause one, or ask for a higher limit",
            retry_after=wait,
        )

    async def _take(self, team: Team, count: int) -> None:
        rate = team.creates_per_minute
        if rate <= 0:
            self._buckets.pop(team.id, None)
            return
        if count > rate:
            raise TooManyRequests(
                f"{count} creates at once are more than team '{team.name}' may make in a "
                f"minute ({rate})",
                retry_after=60,
            )
        if isinstance(self.store, SharedBuckets):
            wait = await self.store.take_tokens(team.id, count, rate, self._wall())
            if wait is not None:
                raise TooManyRequests(
                    f"team '{team.name}' creates sandboxes faster than its limit of {rate} per "
                    f"minute; retry in {wait} s",
                    retry_after=wait,
                )
            return
        now = self._clock()
        bucket = self._buckets.get(team.id)
        if bucket is None:
            bucket = self._buckets[team.id] = _Bucket(float(rate), now)
        # Refill since the last look; a lowered limit caps what was saved up.
        bucket.tokens = min(float(rate), bucket.tokens + (now - bucket.at) * rate / 60.0)
        bucket.at = now
        if bucket.tokens + 1e-9 < count:
            wait = max(1, math.ceil((count - bucket.tokens) * 60.0 / rate))
            raise TooManyRequests(
                f"team '{team.name}' creates sandboxes faster than its limit of {rate} per "
                f"minute; retry in {wait} s",
                retry_after=wait,
            )
        bucket.tokens -= count
