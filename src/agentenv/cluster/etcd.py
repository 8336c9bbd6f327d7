"""One etcd client over every member of the cluster, with a deadline on each call.

aetcd (like any gRPC client) holds one channel to one endpoint. A node agent or a control-plane
replica must keep working when that member dies, so this module keeps a client per endpoint and
sends each call to the current one; a call that fails the way a dead or leaderless member fails
(connection refused, UNAVAILABLE, no answer in time) moves on to the next endpoint and tries
again until the call's deadline. After the deadline it raises `ClusterUnavailable`, naming the
endpoints tried and the last error, so no caller ever waits on etcd without a bound.

Retrying is safe because every write the cluster package makes is either idempotent (a put of
the same value) or a transaction whose failure branch reads back what is there, so a retried
write whose first answer was lost can tell that it had already won.

Which errors mean "try another member" is `etcd_failures`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import aetcd
from aetcd import transactions as tx

from agentenv.cluster.etcd_failures import describe, lease_missing, retryable
from agentenv.config import Settings

log = logging.getLogger(__name__)

T = TypeVar("T")

DEFAULT_PREFIX = "/agentenv/"
# A whole call, retries included: long enough to ride out a leader election (about one
# election timeout, 1 s by default, plus the new leader's first heartbeat).
DEFAULT_DEADLINE_S = 6.0
# One attempt on one member. A follower that has lost its leader holds a request until etcd's
# own request timeout (seconds), even after a new leader is elected; giving up sooner and
# asking again is what keeps the stall of a leader kill near the election time. Attempts get
# FIRST_ATTEMPT_S until every member has run out of it once, then twice as long, and so on up
# to DEFAULT_ATTEMPT_TIMEOUT_S, so a merely slow cluster (fsync on a busy disk) still answers.
FIRST_ATTEMPT_S = 0.5
DEFAULT_ATTEMPT_TIMEOUT_S = 2.0


# A dead member's channel backs off its reconnects (gRPC's default grows to 2 minutes), which
# would keep a restarted member unused long after it is back; keepalives find a member that
# vanished without closing the connection (etcd refuses pings more often than every 5 s).
_CHANNEL_OPTIONS: dict[str, Any] = {
    "grpc.initial_reconnect_backoff_ms": 100,
    "grpc.min_reconnect_backoff_ms": 100,
    "grpc.max_reconnect_backoff_ms": 1000,
    "grpc.keepalive_time_ms": 10_000,
    "grpc.keepalive_timeout_ms": 3_000,
}


class ClusterUnavailable(Exception):
    """No etcd member answered a call before its deadline."""

    def __init__(
        self, what: str, tried: Sequence[str], last_error: BaseException | None, deadline_s: float
    ) -> None:
        self.what = what
        self.tried = tuple(tried)
        self.last_error = last_error
        members = ", ".join(self.tried) or "none"
        last = describe(last_error) if last_error is not None else "none"
        super().__init__(
            f"etcd {what}: no member answered within {deadline_s:g} s "
            f"(tried {members}); last error: {last}"
        )


class LeaseNotFound(Exception):
    """The lease expired or was revoked (etcd no longer knows its id)."""


class WatchCompacted(Exception):
    """Events the watch needs were compacted away: re-read the current state."""

    def __init__(self, revision: int) -> None:
        self.revision = revision
        super().__init__(f"etcd history compacted up to revision {revision}")


@dataclass(frozen=True)
class KeyValue:
    key: bytes
    value: bytes
    create_revision: int
    mod_revision: int
    lease: int


@dataclass(frozen=True)
class WatchEvent:
    kind: Literal["put", "delete"]
    # For a delete, `value` is empty and `mod_revision` is the revision of the deletion.
    kv: KeyValue


@dataclass(frozen=True)
class TxnResult:
    succeeded: bool
    # The answers of the Get operations of the branch that ran, in order.
    ranges: list[list[KeyValue]]


# Transaction parts, built with aetcd's classes (which need no client).
Compare = object
Op = object


def created_at(key: bytes, revision: int) -> Compare:
    """Compares the key's create revision; 0 means the key does not exist."""
    compare: Compare = tx.Create(key) == revision
    return compare


def value_is(key: bytes, value: bytes) -> Compare:
    compare: Compare = tx.Value(key) == value
    return compare


def modified_at(key: bytes, revision: int) -> Compare:
    compare: Compare = tx.Mod(key) == revision
    return compare


def put_op(key: bytes, value: bytes, lease: int = 0) -> Op:
    op: Op = tx.Put(key, value, lease=lease)
    return op


def delete_op(key: bytes) -> Op:
    op: Op = tx.Delete(key)
    return op


def get_op(key: bytes, *, prefix: bool = False) -> Op:
    end = aetcd.utils.prefix_range_end(key) if prefix else None
    op: Op = tx.Get(key, range_end=end)
    return op


def parse_endpoints(raw: str | Sequence[str]) -> tuple[str, ...]:
    """`host:port,host:port` (an `http://` scheme is accepted and dropped) -> ("host:port", ...)."""
    items = raw.split(",") if isinstance(raw, str) else list(raw)
    endpoints: list[str] = []
    for item in items:
        text = item.strip()
        for scheme in ("http://", "https://"):
            if text.startswith(scheme):
                text = text[len(scheme) :]
        text = text.rstrip("/")
        if not text:
            continue
        host, sep, port = text.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"etcd endpoint {item.strip()!r}: expected host:port")
        endpoints.append(f"{host}:{int(port)}")
    return tuple(endpoints)


def _kv(raw: Any) -> KeyValue:
    return KeyValue(
        key=bytes(raw.key),
        value=bytes(raw.value),
        create_revision=int(raw.create_revision),
        mod_revision=int(raw.mod_revision),
        lease=int(raw.lease),
    )


@dataclass
class _Member:
    index: int
    endpoint: str
    client: Any


class Etcd:
    """The cluster's etcd, over all its members. One instance per event loop."""

    def __init__(
        self,
        endpoints: str | Sequence[str],
        *,
        prefix: str = DEFAULT_PREFIX,
        deadline_s: float = DEFAULT_DEADLINE_S,
        attempt_timeout_s: float = DEFAULT_ATTEMPT_TIMEOUT_S,
    ) -> None:
        self.endpoints = parse_endpoints(endpoints)
        if not self.endpoints:
            raise ValueError("no etcd endpoints")
        if not (prefix.startswith("/") and prefix.endswith("/")):
            raise ValueError(f"etcd prefix {prefix!r}: expected /name/")
        self.prefix = prefix
        self.deadline_s = deadline_s
        self.attempt_timeout_s = attempt_timeout_s
        self._members: dict[int, _Member] = {}
        self._current = 0
        self.closed = False

    @classmethod
    def from_settings(cls, settings: Settings) -> Etcd:
        return cls(settings.etcd_endpoints, prefix=settings.etcd_prefix)

    # Keys -----------------------------------------------------------------------------------

    def key(self, *parts: str) -> bytes:
        """`<prefix>a/b/c`; parts are names, never paths, so one cannot reach into another."""
        for part in parts:
            if not part or "/" in part:
                raise ValueError(f"etcd key part {part!r}: expected a non-empty name without /")
        return (self.prefix + "/".join(parts)).encode()

    def dir(self, *parts: str) -> bytes:
        """The prefix holding every key under `parts` (ends with /)."""
        return self.key(*parts) + b"/"

    # The retry loop -------------------------------------------------------------------------

    def _member(self, index: int) -> _Member:
        member = self._members.get(index)
        if member is None:
            host, _, port = self.endpoints[index].rpartition(":")
            client = aetcd.Client(
                host=host,
                port=int(port),
                timeout=self.attempt_timeout_s,
                options=_CHANNEL_OPTIONS,
                connect_wait_timeout=self.attempt_timeout_s,
            )
            member = self._members[index] = _Member(index, self.endpoints[index], client)
        return member

    def _failed(self, index: int) -> None:
        # Concurrent callers that saw the same member fail move the cursor on once, not once each.
        if self._current == index:
            self._current = (index + 1) % len(self.endpoints)

    async def call(
        self,
        what: str,
        op: Callable[[Any], Awaitable[T]],
        *,
        deadline_s: float | None = None,
    ) -> T:
        """Run `op(aetcd client)` against the current member, failing over until the deadline."""
        result, _ = await self._call(what, op, deadline_s)
        return result

    async def _call(
        self, what: str, op: Callable[[Any], Awaitable[T]], deadline_s: float | None
    ) -> tuple[T, _Member]:
        if self.closed:
            raise RuntimeError(f"etcd {what}: the client is closed")
        loop = asyncio.get_running_loop()
        budget = self.deadline_s if deadline_s is None else deadline_s
        deadline = loop.time() + budget
        tried: list[str] = []
        last_error: BaseException | None = None
        failures = 0
        timeouts = 0
        while True:
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise ClusterUnavailable(what, tried, last_error, budget)
            member = self._member(self._current)
            growth = 2 ** (timeouts // len(self.endpoints))
            attempt_s = min(self.attempt_timeout_s, FIRST_ATTEMPT_S * growth)
            try:
                # asyncio.timeout, not wait_for: 3.11's wait_for can swallow a cancel that
                # lands as the call completes, and a heartbeat task then never stops.
                async with asyncio.timeout(min(attempt_s, remaining)):
                    result = await op(member.client)
                return result, member
            except Exception as error:
                if isinstance(error, TimeoutError):
                    timeouts += 1
                if lease_missing(error):
                    raise LeaseNotFound(str(error)) from error
                if not retryable(error):
                    raise
                last_error = error
                if member.endpoint not in tried:
                    tried.append(member.endpoint)
                self._failed(member.index)
                failures += 1
                log.debug("etcd %s on %s failed: %s", what, member.endpoint, describe(error))
            # A refused connection fails at once: pause a little between tries, and longer
            # after each full round of members, so a dead cluster is not spun on.
            rounds = failures // len(self.endpoints)
            pause = 0.02 if failures % len(self.endpoints) else min(0.5, 0.05 * 2**rounds)
            await asyncio.sleep(max(0.0, min(pause, deadline - loop.time())))

    # Operations -----------------------------------------------------------------------------

    async def get(self, key: bytes, *, deadline_s: float | None = None) -> KeyValue | None:
        raw = await self.call("get", lambda c: c.get(key), deadline_s=deadline_s)
        return None if raw is None else _kv(raw)

    async def get_prefix(
        self, prefix: bytes, *, deadline_s: float | None = None
    ) -> tuple[list[KeyValue], int]:
        """Every key under `prefix` and the store revision they were read at."""
        raw = await self.call("get prefix", lambda c: c.get_prefix(prefix), deadline_s=deadline_s)
        return [_kv(kv) for kv in raw.kvs], int(raw.header.revision)

    async def put(
        self, key: bytes, value: bytes, *, lease: int = 0, deadline_s: float | None = None
    ) -> int:
        """Returns the revision of the write."""
        raw = await self.call(
            "put", lambda c: c.put(key, value, lease=lease), deadline_s=deadline_s
        )
        return int(raw.header.revision)

    async def delete(self, key: bytes, *, deadline_s: float | None = None) -> bool:
        raw = await self.call("delete", lambda c: c.delete(key), deadline_s=deadline_s)
        return raw is not None and int(raw.deleted) > 0

    async def txn(
        self,
        compare: Sequence[Compare],
        success: Sequence[Op],
        failure: Sequence[Op] = (),
        *,
        deadline_s: float | None = None,
    ) -> TxnResult:
        async def run(client: Any) -> TxnResult:
            succeeded, responses = await client.transaction(
                compare=list(compare), success=list(success), failure=list(failure)
            )
            ranges = [
                [_kv(get) for _, get in response]
                for response in responses
                if isinstance(response, list)
            ]
            return TxnResult(bool(succeeded), ranges)

        return await self.call("transaction", run, deadline_s=deadline_s)

    async def grant_lease(self, ttl_s: int, *, deadline_s: float | None = None) -> int:
        """A new lease; an attempt whose answer was lost leaves a lease that just expires."""
        raw = await self.call("lease grant", lambda c: c.lease(ttl_s), deadline_s=deadline_s)
        return int(raw.id)

    async def refresh_lease(self, lease_id: int, *, deadline_s: float | None = None) -> int:
        """Keeps the lease alive; returns its TTL, 0 when etcd no longer has it."""

        async def keepalive(client: Any) -> int:
            reply = await client.refresh_lease(lease_id)
            if reply is None:  # the stream closed unanswered: the member went, not the lease
                raise aetcd.ConnectionFailedError("keepalive stream closed without an answer")
            return max(0, int(reply.TTL))

        return await self.call("lease keepalive", keepalive, deadline_s=deadline_s)

    async def revoke_lease(self, lease_id: int, *, deadline_s: float | None = None) -> None:
        """Deletes the lease and its keys now; an already gone lease is not an error."""
        with contextlib.suppress(LeaseNotFound):
            await self.call(
                "lease revoke", lambda c: c.revoke_lease(lease_id), deadline_s=deadline_s
            )

    def watch_prefix(self, prefix: bytes, start_revision: int) -> PrefixWatch:
        """Events under `prefix` from `start_revision` on, across member failures."""
        return PrefixWatch(self, prefix, start_revision)

    async def close(self) -> None:
        """Closes every channel; open watches end (their iteration stops)."""
        self.closed = True
        members, self._members = list(self._members.values()), {}
        for member in members:
            try:
                async with asyncio.timeout(self.attempt_timeout_s):
                    await member.client.close()
            except Exception as error:  # closing a channel to a dead member may fail; it is gone
                log.debug("closing etcd client of %s: %s", member.endpoint, describe(error))

    async def __aenter__(self) -> Etcd:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class PrefixWatch:
    """An async iterator of `WatchEvent`s that survives the death of the member it reads from.

    A watch is one gRPC stream to one member. When that stream breaks, the watch is opened
    again on the next member from the revision after the last event it delivered, so no event
    is lost or repeated. `stop()` ends the iteration (also from another task).
    """

    def __init__(self, etcd: Etcd, prefix: bytes, start_revision: int) -> None:
        self._etcd = etcd
        self._prefix = prefix
        self._next_revision = start_revision
        self._watch: Any = None
        self._events: Any = None
        self._member: _Member | None = None
        self._stopped = False

    def __aiter__(self) -> PrefixWatch:
        return self

    async def __anext__(self) -> WatchEvent:
        while not (self._stopped or self._etcd.closed):
            if self._events is None:
                await self._open()
                continue
            try:
                raw = await self._events.__anext__()
            except StopAsyncIteration:
                # aetcd ends the stream when it is cancelled: by stop(), or a broken channel.
                self._events = None
                continue
            except aetcd.exceptions.RevisionCompactedError as error:
                await self._close_stream()
                raise WatchCompacted(int(error.compacted_revision)) from error
            except Exception as error:
                if not retryable(error):
                    raise
                log.info("etcd watch on %s broke (%s); reopening", self._where(), describe(error))
                if self._member is not None:
                    self._etcd._failed(self._member.index)
                await self._close_stream()
                continue
            kv = _kv(raw.kv)
            self._next_revision = kv.mod_revision + 1
            return WatchEvent("delete" if raw.kind == "DELETE" else "put", kv)
        raise StopAsyncIteration

    @property
    def streaming(self) -> bool:
        """Whether a stream is open: False from a break until it is open again, while the
        events since are not delivered yet."""
        return self._events is not None and not self._stopped

    def _where(self) -> str:
        return self._member.endpoint if self._member is not None else "?"

    async def _open(self) -> None:
        async def start(client: Any) -> Any:
            return await client.watch_prefix(self._prefix, start_revision=self._next_revision)

        try:
            self._watch, self._member = await self._etcd._call("watch", start, None)
        except aetcd.exceptions.RevisionCompactedError as error:
            raise WatchCompacted(int(error.compacted_revision)) from error
        if self._stopped:  # stopped while opening
            await self._close_stream()
            return
        self._events = self._watch.__aiter__()

    async def _close_stream(self) -> None:
        watch, self._watch, self._events = self._watch, None, None
        if watch is not None:
            try:
                async with asyncio.timeout(self._etcd.attempt_timeout_s):
                    await watch.cancel()
            except Exception as error:  # the stream is already broken; nothing left to cancel
                log.debug("cancelling etcd watch: %s", describe(error))

    async def stop(self) -> None:
        self._stopped = True
        await self._close_stream()


# Compare-and-set attempts before giving up: each lost race means another writer won a write
# to the same key in between, so this many in a row is a bug or a runaway writer.
MAX_CAS_ATTEMPTS = 64
# A whole compare-and-set loop, every read and write of it (each call also has its own).
CAS_DEADLINE_S = 30.0


class CasConflict(Exception):
    """A compare-and-set kept losing to other writers, or wrote nothing before its deadline."""


async def cas(
    etcd: Etcd,
    key: bytes,
    change: Callable[[KeyValue | None], bytes | None],
    what: str,
    *,
    also: Callable[[bytes], Sequence[Op]] | None = None,
    conflict: Callable[[str], Exception] = CasConflict,
    attempts: int = MAX_CAS_ATTEMPTS,
    deadline_s: float = CAS_DEADLINE_S,
) -> bytes | None:
    """The compare-and-set loop of every single-key rewrite: read `key`, ask `change` for its
    new value (None: nothing to write), write it guarded by the revision read (with
    `also(value)`'s operations in the same transaction). Returns the value written, or None
    when `change` wrote nothing. A lost race reads again, at most `attempts` times within
    `deadline_s`; then `conflict(message)` is raised (`CasConflict` unless the caller names
    its own). A write whose answer was lost but which landed counts as done: the failure
    branch reads back the very value written, so callers make a value unique where an equal
    one could come from another writer (a random mark in it)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + deadline_s

    def budget() -> float:
        # Each call gets the client's own deadline, never past the loop's.
        left = end - loop.time()
        if left <= 0:
            raise conflict(f"{what}: no write landed within {deadline_s:g} s")
        return min(left, etcd.deadline_s)

    for _ in range(attempts):
        kv = await etcd.get(key, deadline_s=budget())
        value = change(kv)
        if value is None:
            return None
        guard = created_at(key, 0) if kv is None else modified_at(key, kv.mod_revision)
        ops = [put_op(key, value), *(also(value) if also is not None else [])]
        result = await etcd.txn([guard], ops, [get_op(key)], deadline_s=budget())
        if result.succeeded or (result.ranges[0] and result.ranges[0][0].value == value):
            return value
    raise conflict(f"{what}: {attempts} writes lost in a row")
