"""The control plane's store in etcd: what `SqliteStore` keeps, shared by every replica.

With `AGENTENV_ETCD` set, control-plane replicas hold no state of their own: each reads and
writes these keys (under the cluster prefix, `agentenv.cluster.etcd.Etcd`), so any replica
serves any request and losing one loses nothing. Values are JSON.

- `sandboxes/<id>`: the row of a sandbox that is not gone; `gone-sandboxes/<id>` once it is
  (the move is one transaction). Live rows are what nearly every query reads (the reaper, the
  proxy's signed URLs, team counts), so they are one prefix that stays as small as what runs;
  gone rows are read only by the queries that need history (a list including gone ones,
  `count_by_state`, `spawns`). A row's `seq` is the create revision of its first key: etcd's
  revisions only grow, so it orders rows by insertion as SQLite's autoincrement does; it is
  written into the JSON on the first rewrite, so a move to `gone-sandboxes/` keeps it.
- Every write of a row is a compare-and-set on its key's mod revision, retried on a lost race
  after re-reading (so `update` never undoes a concurrent transition and `transition` checks
  the state it read is still there); of two replicas moving a sandbox from the same state,
  exactly one `transition` returns True. Each write carries a random `_w` mark: when `Etcd`
  retries a transaction whose first answer was lost, the failure branch's read-back finds its
  own mark and the write counts as done, not as a lost race.
- `sandbox-logs/<id>/<ns>-<writer>-<n>`: lifecycle lines, ordered by time; at most
  `MAX_LOG_LINES` per sandbox are kept (the oldest go first).
- `teams/<id>` (+ `team-names/<name>` → id, so names are unique), `api-keys/<id>` (+ the same
  JSON at `api-key-hashes/<sha256>`, written in one transaction, so a request's key check is
  one read), `snapshot-owners/<id>`, `idempotency/<key id>/<key>`. Free-form parts (names,
  client idempotency keys) are base64url-encoded so they stay one key part.

Each call has `Etcd`'s deadline (member failover included) and raises its `ClusterUnavailable`
past it; the compare-and-set loops are bounded (`StoreConflict`).
"""

from __future__ import annotations

import base64
import dataclasses
import json
import math
import secrets
import time
from collections.abc import Callable, Iterable
from typing import Any

from agentenv.cluster.etcd import (
    Etcd,
    KeyValue,
    Op,
    created_at,
    delete_op,
    get_op,
    modified_at,
    put_op,
    value_is,
)
from agentenv.control.store import (
    ACTIVE_STATES,
    BUILD_METADATA,
    DEFAULT_TEAM,
    LIVE_STATES,
    ApiKey,
    LogLine,
    SandboxRecord,
    SandboxState,
    Team,
)

# Lifecycle lines kept per sandbox (the logs routes page through at most this many).
MAX_LOG_LINES = 1000
# A replica looks at a sandbox's line count every this many of its own writes to it.
_TRIM_EVERY = 50
# Compare-and-set attempts before giving up: each lost race means another writer won a write
# to the same key in between, so this many in a row is a bug or a runaway writer.
MAX_CAS_ATTEMPTS = 64
# Operations per transaction etcd accepts by default (`--max-txn-ops`).
_MAX_TXN_OPS = 128
_FIELDS = {f.name for f in dataclasses.fields(SandboxRecord)} - {"seq"}


class StoreConflict(Exception):
    """A compare-and-set kept losing to other writers (`MAX_CAS_ATTEMPTS` in a row)."""


class DuplicateKey(Exception):
    """An insert of a row whose id (or unique name) exists already."""


def _b64(text: str) -> str:
    return base64.urlsafe_b64encode(text.encode()).decode().rstrip("=") or "="


def _part_ok(part: str) -> bool:
    return bool(part) and "/" not in part


def _dumps(value: dict[str, Any]) -> bytes:
    return json.dumps(value, separators=(",", ":"), sort_keys=True).encode()


def _is_build(row: dict[str, Any]) -> bool:
    return (row.get("metadata") or {}).get(BUILD_METADATA) is not None


def _record(row: dict[str, Any]) -> SandboxRecord:
    fields = {k: v for k, v in row.items() if k in _FIELDS}
    fields["state"] = SandboxState(fields["state"])
    for name in ("auto_pause", "auto_resume", "allow_internet", "auto_pause_memory"):
        fields[name] = bool(fields[name])
    fields["team_id"] = fields.get("team_id") or DEFAULT_TEAM
    return SandboxRecord(**fields, seq=int(row["seq"]))


def _active_ends(rows: list[dict[str, Any]], team_id: str) -> list[float]:
    """The end times of the team's sandboxes that hold (or are about to hold) a VM."""
    active = {s.value for s in ACTIVE_STATES}
    return [
        float(r["end_at"])
        for r in rows
        if (r.get("team_id") or DEFAULT_TEAM) == team_id
        and not _is_build(r)
        and r["state"] in active
    ]


def _row_value(value: Any) -> Any:
    return value.value if isinstance(value, SandboxState) else value


@dataclasses.dataclass
class _Row:
    """A sandbox row as read: where it is, at which revision, and its fields (with `seq`)."""

    key: bytes
    kv: KeyValue
    data: dict[str, Any]

    @property
    def state(self) -> SandboxState:
        return SandboxState(self.data["state"])


class EtcdStore:
    """The `Store` protocol on etcd. One instance per event loop (its `Etcd` client's)."""

    def __init__(self, etcd: Etcd) -> None:
        self.etcd = etcd
        # Names this replica's log keys apart from another's written in the same nanosecond.
        self._writer = secrets.token_hex(3)
        self._log_n = 0
        self._log_writes: dict[str, int] = {}
        self._default_team_ready = False

    async def close(self) -> None:
        await self.etcd.close()

    # -- keys --------------------------------------------------------------------------------

    def _live(self, sandbox_id: str) -> bytes:
        return self.etcd.key("sandboxes", sandbox_id)

    def _gone(self, sandbox_id: str) -> bytes:
        return self.etcd.key("gone-sandboxes", sandbox_id)

    def _where(self, sandbox_id: str, state: SandboxState) -> bytes:
        return self._gone(sandbox_id) if state is SandboxState.GONE else self._live(sandbox_id)

    # -- sandbox rows ------------------------------------------------------------------------

    @staticmethod
    def _decode(kv: KeyValue) -> dict[str, Any]:
        data: dict[str, Any] = json.loads(kv.value)
        data.setdefault("seq", kv.create_revision)
        return data

    def _row_of(self, ranges: list[list[KeyValue]]) -> _Row | None:
        for found in ranges:
            if found:
                kv = found[0]
                return _Row(kv.key, kv, self._decode(kv))
        return None

    async def _read(self, sandbox_id: str) -> _Row | None:
        if not _part_ok(sandbox_id):
            return None
        live, gone = self._live(sandbox_id), self._gone(sandbox_id)
        result = await self.etcd.txn([], [get_op(live), get_op(gone)])
        return self._row_of(result.ranges)

    async def _scan(self, *, gone: bool) -> list[dict[str, Any]]:
        """Live rows, and with `gone` the gone ones too, in insertion (`seq`) order."""
        kvs, _ = await self.etcd.get_prefix(self.etcd.dir("sandboxes"))
        rows = [self._decode(kv) for kv in kvs]
        if gone:
            more, _ = await self.etcd.get_prefix(self.etcd.dir("gone-sandboxes"))
            rows += [self._decode(kv) for kv in more]
        rows.sort(key=lambda r: int(r["seq"]))
        return rows

    async def insert(self, rec: SandboxRecord) -> None:
        if not _part_ok(rec.id):
            raise ValueError(f"sandbox id {rec.id!r}: not a valid key part")
        row = {k: _row_value(v) for k, v in dataclasses.asdict(rec).items() if k != "seq"}
        row["_w"] = mark = secrets.token_hex(8)
        key = self._where(rec.id, rec.state)
        live, gone = self._live(rec.id), self._gone(rec.id)
        result = await self.etcd.txn(
            [created_at(live, 0), created_at(gone, 0)],
            [put_op(key, _dumps(row)), get_op(key)],
            [get_op(live), get_op(gone)],
        )
        found = self._row_of(result.ranges)
        if found is None or found.data.get("_w") != mark:
            raise DuplicateKey(f"sandbox {rec.id} exists already")
        rec.seq = int(found.data["seq"])

    async def get(self, sandbox_id: str) -> SandboxRecord | None:
        row = await self._read(sandbox_id)
        return None if row is None else _record(row.data)

    async def _rewrite(
        self,
        sandbox_id: str,
        expected: frozenset[SandboxState] | None,
        new: SandboxState | None,
        changes: dict[str, Any],
        match: dict[str, Any] | None = None,
    ) -> bool:
        """The compare-and-set loop under `transition` (`expected`, `new`), `update` and
        `claim` (`match`: fields the row must still hold, else nothing is written)."""
        unknown = set(changes) - _FIELDS - {"state"}
        if unknown:
            raise ValueError(f"unknown sandbox fields: {', '.join(sorted(unknown))}")
        row = await self._read(sandbox_id)
        for _ in range(MAX_CAS_ATTEMPTS):
            if row is None or (expected is not None and row.state not in expected):
                return False
            if match and any(row.data.get(k) != v for k, v in match.items()):
                return False
            # Keys of older schemas (fields a record no longer has) are read past by
            # `_record` and dropped by the next write.
            data = {k: v for k, v in row.data.items() if k in _FIELDS or k == "seq"}
            data.update({k: _row_value(v) for k, v in changes.items()})
            if new is not None:
                data["state"] = new.value
            data["_w"] = mark = secrets.token_hex(8)
            target = self._where(sandbox_id, SandboxState(data["state"]))
            ops = [put_op(target, _dumps(data))]
            if target != row.key:
                ops.insert(0, delete_op(row.key))
            result = await self.etcd.txn(
                [modified_at(row.key, row.kv.mod_revision)],
                ops,
                [get_op(self._live(sandbox_id)), get_op(self._gone(sandbox_id))],
            )
            if result.succeeded:
                return True
            row = self._row_of(result.ranges)
            if row is not None and row.data.get("_w") == mark:
                return True  # an earlier attempt of this very write won; its answer was lost
        raise StoreConflict(f"sandbox {sandbox_id}: {MAX_CAS_ATTEMPTS} writes lost in a row")

    async def _cas(
        self,
        key: bytes,
        change: Callable[[KeyValue | None], bytes | None],
        what: str,
        *,
        also: Callable[[bytes], list[Op]] | None = None,
    ) -> bool:
        """The compare-and-set loop of every single-key rewrite: read `key`, ask `change` for
        its new value (None: nothing to write, False), write it guarded by the revision read
        (with `also(value)`'s operations in the same transaction). A lost race reads again,
        at most `MAX_CAS_ATTEMPTS` times (then `StoreConflict`). A write whose answer was lost
        but which landed counts as done: the failure branch reads back the very value written
        (callers make values unique where equal values could come from another writer).
        `_rewrite` (a row that moves between keys) and `take_places` (a gate key) are the two
        loops with their own guard."""
        for _ in range(MAX_CAS_ATTEMPTS):
            kv = await self.etcd.get(key)
            value = change(kv)
            if value is None:
                return False
            guard = created_at(key, 0) if kv is None else modified_at(key, kv.mod_revision)
            ops = [put_op(key, value), *(also(value) if also is not None else [])]
            result = await self.etcd.txn([guard], ops, [get_op(key)])
            if result.succeeded or (result.ranges[0] and result.ranges[0][0].value == value):
                return True
        raise StoreConflict(f"{what}: {MAX_CAS_ATTEMPTS} writes lost in a row")

    async def transition(
        self,
        sandbox_id: str,
        expected: SandboxState | Iterable[SandboxState],
        new: SandboxState,
        **changes: Any,
    ) -> bool:
        states = frozenset([expected] if isinstance(expected, SandboxState) else expected)
        return await self._rewrite(sandbox_id, states, new, changes)

    async def update(self, sandbox_id: str, **changes: Any) -> None:
        await self._rewrite(sandbox_id, None, None, changes)

    async def claim(
        self, sandbox_id: str, state: SandboxState, was: str | None, replica_id: str
    ) -> bool:
        # A row from before stamps has no `replica_id` key at all: `get` reads that as None.
        return await self._rewrite(
            sandbox_id, frozenset([state]), None, {"replica_id": replica_id}, {"replica_id": was}
        )

    async def select(
        self,
        states: Iterable[SandboxState] | None = None,
        *,
        after_seq: int = 0,
        descending: bool = False,
        before_seq: int | None = None,
        team_id: str | None = None,
    ) -> list[SandboxRecord]:
        wanted = None if states is None else {s.value for s in states}
        rows = await self._scan(gone=wanted is None or SandboxState.GONE.value in wanted)
        out = [
            _record(r)
            for r in rows
            if (wanted is None or r["state"] in wanted)
            and (team_id is None or (r.get("team_id") or DEFAULT_TEAM) == team_id)
            and (not after_seq or int(r["seq"]) > after_seq)
            and (before_seq is None or int(r["seq"]) < before_seq)
        ]
        if descending:
            out.reverse()
        return out

    async def _live_rows(self) -> list[dict[str, Any]]:
        return await self._scan(gone=False)

    async def envd_tokens(self) -> list[tuple[str, str]]:
        return [
            (str(r["id"]), str(r["envd_token"]))
            for r in await self._live_rows()
            if r.get("envd_token") is not None
        ]

    async def expired(self, now: float) -> list[SandboxRecord]:
        return [
            _record(r)
            for r in await self._live_rows()
            if r["state"] == SandboxState.RUNNING.value and float(r["end_at"]) <= now
        ]

    async def next_deadline(self) -> float | None:
        ends = [
            float(r["end_at"])
            for r in await self._live_rows()
            if r["state"] == SandboxState.RUNNING.value
        ]
        return min(ends) if ends else None

    async def count_by_state(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for r in await self._scan(gone=True):
            if not _is_build(r):
                counts[r["state"]] = counts.get(r["state"], 0) + 1
        return counts

    async def count_active(self, team_id: str) -> tuple[int, float | None]:
        ends = _active_ends(await self._live_rows(), team_id)
        return len(ends), (min(ends) if ends else None)

    async def count_builds(self) -> int:
        live = {s.value for s in LIVE_STATES}
        return sum(1 for r in await self._live_rows() if _is_build(r) and r["state"] in live)

    async def spawns(self, team_id: str | None = None) -> dict[str, tuple[int, float]]:
        out: dict[str, tuple[int, float]] = {}
        for r in await self._scan(gone=True):
            if _is_build(r) or r.get("envd_url") is None:
                continue
            if team_id is not None and (r.get("team_id") or DEFAULT_TEAM) != team_id:
                continue
            count, last = out.get(r["template"], (0, 0.0))
            out[r["template"]] = (count + 1, max(last, float(r["started_at"])))
        return out

    # -- logs --------------------------------------------------------------------------------

    async def log(self, sandbox_id: str, message: str, level: str = "info") -> None:
        if not _part_ok(sandbox_id):
            raise ValueError(f"sandbox id {sandbox_id!r}: not a valid key part")
        ns = time.time_ns()
        self._log_n += 1
        part = f"{ns:020d}-{self._writer}-{self._log_n:012d}"
        key = self.etcd.key("sandbox-logs", sandbox_id, part)
        line = {"ts": ns / 1e9, "level": level, "message": message}
        await self.etcd.put(key, _dumps(line))
        writes = self._log_writes[sandbox_id] = self._log_writes.get(sandbox_id, 0) + 1
        if len(self._log_writes) > 10_000:  # a counter per sandbox ever logged: keep it small
            self._log_writes.clear()
        if writes % _TRIM_EVERY == 0:
            await self._trim_logs(sandbox_id)

    async def _trim_logs(self, sandbox_id: str) -> None:
        kvs, _ = await self.etcd.get_prefix(self.etcd.dir("sandbox-logs", sandbox_id))
        excess = sorted(kv.key for kv in kvs)[: max(0, len(kvs) - MAX_LOG_LINES)]
        for i in range(0, len(excess), _MAX_TXN_OPS):
            await self.etcd.txn([], [delete_op(k) for k in excess[i : i + _MAX_TXN_OPS]])

    async def logs(
        self, sandbox_id: str, *, start: float = 0.0, limit: int = 1000
    ) -> list[LogLine]:
        if not _part_ok(sandbox_id):
            return []
        kvs, _ = await self.etcd.get_prefix(self.etcd.dir("sandbox-logs", sandbox_id))
        out: list[LogLine] = []
        for kv in sorted(kvs, key=lambda kv: kv.key):
            line = json.loads(kv.value)
            if float(line["ts"]) >= start:
                out.append(LogLine(sandbox_id, float(line["ts"]), line["level"], line["message"]))
                if len(out) >= limit:
                    break
        return out

    # -- teams -------------------------------------------------------------------------------

    def _team_key(self, team_id: str) -> bytes:
        return self.etcd.key("teams", team_id)

    def _team_name_key(self, name: str) -> bytes:
        return self.etcd.key("team-names", _b64(name))

    async def _put_team(self, team: Team) -> bool:
        """Writes a new team if neither its id nor its name is taken."""
        key, name_key = self._team_key(team.id), self._team_name_key(team.name)
        value = _dumps(dataclasses.asdict(team))
        result = await self.etcd.txn(
            [created_at(key, 0), created_at(name_key, 0)],
            [put_op(key, value), put_op(name_key, team.id.encode())],
            [get_op(key)],
        )
        # A retried attempt finds its own first write (a team is written only once).
        return result.succeeded or (bool(result.ranges[0]) and result.ranges[0][0].value == value)

    async def _ensure_default_team(self) -> None:
        """The default team always exists (SQLite's migration makes it at open)."""
        if self._default_team_ready:
            return
        if await self.etcd.get(self._team_key(DEFAULT_TEAM)) is None:
            await self._put_team(Team(DEFAULT_TEAM, DEFAULT_TEAM, time.time()))
        self._default_team_ready = True

    async def add_team(self, team_id: str, name: str) -> Team:
        await self._ensure_default_team()
        if not _part_ok(team_id):
            raise ValueError(f"team id {team_id!r}: not a valid key part")
        team = Team(team_id, name, time.time())
        if not await self._put_team(team):
            raise DuplicateKey(f"team {team_id} or a team named {name!r} exists already")
        return team

    @staticmethod
    def _team_of(kv: KeyValue) -> Team:
        return Team(**json.loads(kv.value))

    async def team(self, ref: str) -> Team | None:
        await self._ensure_default_team()
        ops = [get_op(self._team_name_key(ref))]
        if _part_ok(ref):
            ops.insert(0, get_op(self._team_key(ref)))
        result = await self.etcd.txn([], ops)
        by_id = result.ranges[0] if _part_ok(ref) else []
        if by_id:
            return self._team_of(by_id[0])
        by_name = result.ranges[-1]
        if not by_name:
            return None
        kv = await self.etcd.get(self._team_key(by_name[0].value.decode()))
        return None if kv is None else self._team_of(kv)

    async def teams(self) -> list[Team]:
        await self._ensure_default_team()
        kvs, _ = await self.etcd.get_prefix(self.etcd.dir("teams"))
        return sorted((self._team_of(kv) for kv in kvs), key=lambda t: t.created_at)

    async def set_team_limits(
        self, team_id: str, *, max_sandboxes: int | None, creates_per_minute: int | None
    ) -> bool:
        await self._ensure_default_team()
        if not _part_ok(team_id):
            return False
        if max_sandboxes is None and creates_per_minute is None:
            return await self.etcd.get(self._team_key(team_id)) is not None

        def limited(kv: KeyValue | None) -> bytes | None:
            if kv is None:
                return None
            team = self._team_of(kv)
            if max_sandboxes is not None:
                team = dataclasses.replace(team, max_sandboxes=max_sandboxes)
            if creates_per_minute is not None:
                team = dataclasses.replace(team, creates_per_minute=creates_per_minute)
            # Setting limits is idempotent: finding the wanted value is as good as writing it.
            return _dumps(dataclasses.asdict(team))

        return await self._cas(self._team_key(team_id), limited, f"team {team_id}")

    # -- snapshot owners ---------------------------------------------------------------------

    async def set_snapshot_owner(self, snapshot_id: str, team_id: str) -> None:
        await self.etcd.put(self.etcd.key("snapshot-owners", _b64(snapshot_id)), team_id.encode())

    async def take_tokens(self, team_id: str, count: int, rate: int, now: float) -> int | None:
        """The team's create-rate bucket, one for every replica (`control.tenants`): refilled
        at `rate` per minute by wall time since the last take (replicas' clocks roughly
        agree), a compare-and-set per take."""
        wait: int | None = None

        def take(kv: KeyValue | None) -> bytes | None:
            nonlocal wait
            wait = None
            if kv is None:
                tokens = float(rate)
            else:
                saved = json.loads(kv.value)
                since = max(0.0, now - float(saved["at"]))
                tokens = min(float(rate), float(saved["tokens"]) + since * rate / 60.0)
            if tokens + 1e-9 < count:
                wait = max(1, math.ceil((count - tokens) * 60.0 / rate))
                return None
            # The mark makes this take's value unique, so a lost answer is told from a rival.
            mark = secrets.token_hex(8)
            return json.dumps({"tokens": tokens - count, "at": now, "_w": mark}).encode()

        key = self.etcd.key("rate-buckets", _b64(team_id))
        await self._cas(key, take, f"team {team_id}'s rate bucket")
        return wait

    async def take_places(
        self, team_id: str, count: int, limit: int, hold_id: str, lease: int
    ) -> float | None:
        """Holds `count` of the team's `limit` places for every replica to see
        (`team-holds/<team>/<hold_id>`, under `lease`), or returns the team's soonest
        sandbox end (0 if none) and holds nothing.

        Exact across replicas: every hold bumps the team's gate key in the transaction that
        writes it, guarded by the gate's revision read first, so of two admissions that saw
        the same places one fails and reads again. The holds are read before the rows: a
        hold released after that read was released after its row was inserted, so the rows
        read next include it (counted twice at worst, never missed)."""
        team = _b64(team_id)
        gate = self.etcd.key("team-gates", team)
        hold = self.etcd.key("team-holds", team, hold_id)
        for _ in range(MAX_CAS_ATTEMPTS):
            gate_kv = await self.etcd.get(gate)
            holds, _ = await self.etcd.get_prefix(self.etcd.dir("team-holds", team))
            held = sum(int(json.loads(kv.value)["count"]) for kv in holds)
            ends = _active_ends(await self._live_rows(), team_id)
            if len(ends) + held + count > limit:
                return min(ends) if ends else 0.0
            guard = (
                created_at(gate, 0) if gate_kv is None else modified_at(gate, gate_kv.mod_revision)
            )
            value = json.dumps({"count": count, "at": time.time()}).encode()
            result = await self.etcd.txn(
                [guard],
                [put_op(gate, hold_id.encode()), put_op(hold, value, lease)],
                [get_op(hold)],
            )
            if result.succeeded or result.ranges[0]:
                # Won, or an earlier attempt of this very hold won and its answer was lost.
                return None
        raise StoreConflict(f"team {team_id}: {MAX_CAS_ATTEMPTS} admissions lost their race")

    async def release_places(self, team_id: str, hold_id: str) -> None:
        await self.etcd.delete(self.etcd.key("team-holds", _b64(team_id), hold_id))

    async def snapshot_owner(self, snapshot_id: str) -> str:
        kv = await self.etcd.get(self.etcd.key("snapshot-owners", _b64(snapshot_id)))
        return kv.value.decode() if kv is not None else DEFAULT_TEAM

    # -- API keys ----------------------------------------------------------------------------

    def _key_key(self, key_id: str) -> bytes:
        return self.etcd.key("api-keys", key_id)

    def _hash_key(self, key_hash: str) -> bytes:
        return self.etcd.key("api-key-hashes", _b64(key_hash))

    @staticmethod
    def _api_key_of(kv: KeyValue) -> ApiKey:
        data = json.loads(kv.value)
        data.pop("hash", None)
        return ApiKey(**data)

    async def add_key(
        self, key_id: str, name: str, prefix: str, key_hash: str, team_id: str = DEFAULT_TEAM
    ) -> ApiKey:
        if not _part_ok(key_id):
            raise ValueError(f"API key id {key_id!r}: not a valid key part")
        key = ApiKey(key_id, name, prefix, time.time(), None, team_id)
        value = _dumps({**dataclasses.asdict(key), "hash": key_hash})
        by_id, by_hash = self._key_key(key_id), self._hash_key(key_hash)
        result = await self.etcd.txn(
            [created_at(by_id, 0), created_at(by_hash, 0)],
            [put_op(by_id, value), put_op(by_hash, value)],
            [get_op(by_id)],
        )
        if not (result.succeeded or (result.ranges[0] and result.ranges[0][0].value == value)):
            raise DuplicateKey(f"API key {key_id} (or its hash) exists already")
        return key

    async def add_first_key(
        self, key_id: str, name: str, prefix: str, key_hash: str, team_id: str = DEFAULT_TEAM
    ) -> ApiKey | None:
        """Under a marker made in the same transaction: once any replica made the first key,
        no other ever does (even after every key was revoked)."""
        if not _part_ok(key_id):
            raise ValueError(f"API key id {key_id!r}: not a valid key part")
        key = ApiKey(key_id, name, prefix, time.time(), None, team_id)
        value = _dumps({**dataclasses.asdict(key), "hash": key_hash})
        by_id, by_hash = self._key_key(key_id), self._hash_key(key_hash)
        marker = self.etcd.key("first-api-key")
        result = await self.etcd.txn(
            [created_at(marker, 0), created_at(by_id, 0), created_at(by_hash, 0)],
            [put_op(marker, key_id.encode()), put_op(by_id, value), put_op(by_hash, value)],
            [],
        )
        return key if result.succeeded else None

    async def key_by_hash(self, key_hash: str) -> ApiKey | None:
        kv = await self.etcd.get(self._hash_key(key_hash))
        return None if kv is None else self._api_key_of(kv)

    async def key(self, key_id: str) -> ApiKey | None:
        if not _part_ok(key_id):
            return None
        kv = await self.etcd.get(self._key_key(key_id))
        return None if kv is None else self._api_key_of(kv)

    async def keys(self) -> list[ApiKey]:
        kvs, _ = await self.etcd.get_prefix(self.etcd.dir("api-keys"))
        return sorted((self._api_key_of(kv) for kv in kvs), key=lambda k: k.created_at)

    async def revoke_key(self, key_id: str) -> bool:
        if not _part_ok(key_id):
            return False

        def revoked(kv: KeyValue | None) -> bytes | None:
            if kv is None:
                return None
            data = json.loads(kv.value)
            if data.get("revoked_at") is not None:
                return None
            data["revoked_at"] = time.time()
            return _dumps(data)

        def by_hash(value: bytes) -> list[Op]:
            # The copy the key check reads, written in the same transaction.
            return [put_op(self._hash_key(json.loads(value)["hash"]), value)]

        return await self._cas(self._key_key(key_id), revoked, f"API key {key_id}", also=by_hash)

    # -- idempotency -------------------------------------------------------------------------

    def _idem_key(self, api_key_id: str, key: str) -> bytes:
        return self.etcd.key("idempotency", _b64(api_key_id), _b64(key))

    async def claim_idempotency(self, api_key_id: str, key: str, body_hash: str) -> bool:
        at = self._idem_key(api_key_id, key)
        value = _dumps(
            {
                "body_hash": body_hash,
                "sandbox_id": None,
                "created_at": time.time(),
                "_w": secrets.token_hex(8),
            }
        )
        result = await self.etcd.txn([created_at(at, 0)], [put_op(at, value)], [get_op(at)])
        return result.succeeded or bool(result.ranges[0] and result.ranges[0][0].value == value)

    async def idempotency(self, api_key_id: str, key: str) -> tuple[str, str | None] | None:
        kv = await self.etcd.get(self._idem_key(api_key_id, key))
        if kv is None:
            return None
        data = json.loads(kv.value)
        return str(data["body_hash"]), data.get("sandbox_id")

    async def complete_idempotency(self, api_key_id: str, key: str, sandbox_id: str) -> None:

        def completed(kv: KeyValue | None) -> bytes | None:
            if kv is None:
                return None
            data = json.loads(kv.value)
            data["sandbox_id"] = sandbox_id
            return _dumps(data)

        await self._cas(self._idem_key(api_key_id, key), completed, f"idempotency key {key!r}")

    async def release_idempotency(self, api_key_id: str, key: str) -> None:
        at = self._idem_key(api_key_id, key)
        kv = await self.etcd.get(at)
        if kv is None or json.loads(kv.value).get("sandbox_id") is not None:
            return
        # Only the claim as read: a completed one (or a new claim) stays.
        await self.etcd.txn([value_is(at, kv.value)], [delete_op(at)])

    async def expire_idempotency(self, older_than: float) -> None:
        kvs, _ = await self.etcd.get_prefix(self.etcd.dir("idempotency"))
        for kv in kvs:
            if float(json.loads(kv.value)["created_at"]) < older_than:
                # Only as read: a key completed meanwhile is rewritten, and stays until next time.
                await self.etcd.txn([modified_at(kv.key, kv.mod_revision)], [delete_op(kv.key)])
