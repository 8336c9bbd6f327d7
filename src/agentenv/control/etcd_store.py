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

This module holds the sandbox rows and their logs; teams and admission are `etcd_tenancy`, keys
`etcd_keys`, the shared client and compare-and-set loop `etcd_kv`.
"""

from __future__ import annotations

import dataclasses
import json
import secrets
import time
from collections.abc import Iterable
from typing import Any

from agentenv.cluster.etcd import (
    Etcd,
    KeyValue,
    created_at,
    delete_op,
    get_op,
    modified_at,
    put_op,
)
from agentenv.control.etcd_keys import EtcdKeys
from agentenv.control.etcd_kv import (
    MAX_CAS_ATTEMPTS,
    DuplicateKey,
    StoreConflict,
    _active_ends,
    _dumps,
    _is_build,
    _part_ok,
)
from agentenv.control.etcd_rows import Row, RowView, decode
from agentenv.control.etcd_tenancy import EtcdTenancy
from agentenv.control.store import (
    DEFAULT_TEAM,
    LIVE_STATES,
    LogLine,
    SandboxRecord,
    SandboxState,
)

# Lifecycle lines kept per sandbox (the logs routes page through at most this many).
MAX_LOG_LINES = 1000
# A replica looks at a sandbox's line count every this many of its own writes to it.
_TRIM_EVERY = 50
# Operations per transaction etcd accepts by default (`--max-txn-ops`).
_MAX_TXN_OPS = 128
_FIELDS = {f.name for f in dataclasses.fields(SandboxRecord)} - {"seq"}


def _record(row: dict[str, Any]) -> SandboxRecord:
    fields = {k: v for k, v in row.items() if k in _FIELDS}
    fields["state"] = SandboxState(fields["state"])
    for name in ("auto_pause", "auto_resume", "allow_internet", "auto_pause_memory"):
        fields[name] = bool(fields[name])
    fields["team_id"] = fields.get("team_id") or DEFAULT_TEAM
    return SandboxRecord(**fields, seq=int(row["seq"]))


def _row_value(value: Any) -> Any:
    return value.value if isinstance(value, SandboxState) else value


class EtcdStore(EtcdTenancy, EtcdKeys):
    """The `Store` protocol on etcd: sandbox rows and their logs here, teams and admission in
    `EtcdTenancy`, API and idempotency keys in `EtcdKeys`. One instance per event loop (its
    `Etcd` client's)."""

    def __init__(self, etcd: Etcd) -> None:
        super().__init__(etcd)
        # Names this replica's log keys apart from another's written in the same nanosecond.
        self._writer = secrets.token_hex(3)
        self._log_n = 0
        self._log_writes: dict[str, int] = {}
        self._default_team_ready = False
        # The rows as this replica last saw them (`etcd_rows`): a write's compare-and-set
        # starts from there instead of reading the row first, and the proxy forwards on a
        # running row from there. Kept by the store's own reads and writes, and once `open`
        # has run, by a watch on the live rows.
        self.rows = RowView(etcd, etcd.dir("sandboxes"), self._id_of_key)

    # -- keys --------------------------------------------------------------------------------

    def _live(self, sandbox_id: str) -> bytes:
        return self.etcd.key("sandboxes", sandbox_id)

    def _gone(self, sandbox_id: str) -> bytes:
        return self.etcd.key("gone-sandboxes", sandbox_id)

    def _where(self, sandbox_id: str, state: SandboxState) -> bytes:
        return self._gone(sandbox_id) if state is SandboxState.GONE else self._live(sandbox_id)

    # -- sandbox rows ------------------------------------------------------------------------

    def _id_of_key(self, key: bytes) -> str:
        return key.rsplit(b"/", 1)[-1].decode()

    def _row_of(self, ranges: list[list[KeyValue]]) -> Row | None:
        for found in ranges:
            if found:
                kv = found[0]
                return Row(kv.key, kv, decode(kv))
        return None

    def _remember(self, sandbox_id: str, row: Row | None) -> Row | None:
        if row is None:
            self.rows.forget(sandbox_id)
        else:
            self.rows.learn(sandbox_id, row.kv)
        return row

    async def open(self) -> None:
        """Starts following the live rows (`recent`) and the API keys' hashes."""
        await super().open()
        self.rows.start()
        self.key_hashes.start()

    async def close(self) -> None:
        await self.rows.stop()
        await self.key_hashes.stop()
        await super().close()

    async def _read(self, sandbox_id: str) -> Row | None:
        if not _part_ok(sandbox_id):
            return None
        live, gone = self._live(sandbox_id), self._gone(sandbox_id)
        result = await self.etcd.txn([], [get_op(live), get_op(gone)])
        return self._remember(sandbox_id, self._row_of(result.ranges))

    async def _scan(self, *, gone: bool) -> list[dict[str, Any]]:
        """Live rows, and with `gone` the gone ones too, in insertion (`seq`) order."""
        kvs, _ = await self.etcd.get_prefix(self.etcd.dir("sandboxes"))
        rows = [decode(kv) for kv in kvs]
        if gone:
            more, _ = await self.etcd.get_prefix(self.etcd.dir("gone-sandboxes"))
            rows += [decode(kv) for kv in more]
        rows.sort(key=lambda r: int(r["seq"]))
        return rows

    async def insert(self, rec: SandboxRecord, *, note: str | None = None) -> None:
        if not _part_ok(rec.id):
            raise ValueError(f"sandbox id {rec.id!r}: not a valid key part")
        row = {k: _row_value(v) for k, v in dataclasses.asdict(rec).items() if k != "seq"}
        row["_w"] = mark = secrets.token_hex(8)
        key = self._where(rec.id, rec.state)
        live, gone = self._live(rec.id), self._gone(rec.id)
        result = await self.etcd.txn(
            [created_at(live, 0), created_at(gone, 0)],
            [put_op(key, _dumps(row)), *self._note_ops(rec.id, note), get_op(key)],
            [get_op(live), get_op(gone)],
        )
        found = self._remember(rec.id, self._row_of(result.ranges))
        if found is None or found.data.get("_w") != mark:
            raise DuplicateKey(f"sandbox {rec.id} exists already")
        rec.seq = int(found.data["seq"])
        if note is not None:
            await self._logged(rec.id)

    async def get(self, sandbox_id: str) -> SandboxRecord | None:
        row = await self._read(sandbox_id)
        return None if row is None else _record(row.data)

    def recent(self, sandbox_id: str) -> SandboxRecord | None:
        row = self.rows.current(sandbox_id) if _part_ok(sandbox_id) else None
        return None if row is None else _record(row.data)

    async def _rewrite(
        self,
        sandbox_id: str,
        expected: frozenset[SandboxState] | None,
        new: SandboxState | None,
        changes: dict[str, Any],
        match: dict[str, Any] | None = None,
        note: str | None = None,
    ) -> bool:
        """The compare-and-set loop under `transition` (`expected`, `new`), `update` and
        `claim` (`match`: fields the row must still hold, else nothing is written)."""
        unknown = set(changes) - _FIELDS - {"state"}
        if unknown:
            raise ValueError(f"unknown sandbox fields: {', '.join(sorted(unknown))}")
        row = self.rows.latest(sandbox_id) if _part_ok(sandbox_id) else None
        fresh = row is None
        if row is None:
            row = await self._read(sandbox_id)
        for _ in range(MAX_CAS_ATTEMPTS):
            if (
                row is None
                or (expected is not None and SandboxState(row.state) not in expected)
                or (match and any(row.data.get(k) != v for k, v in match.items()))
            ):
                if fresh:
                    return False
                # What this replica last saw says no; what etcd holds now decides.
                row, fresh = await self._read(sandbox_id), True
                continue
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
                [*ops, *self._note_ops(sandbox_id, note), get_op(target)],
                [get_op(self._live(sandbox_id)), get_op(self._gone(sandbox_id))],
            )
            row, fresh = self._remember(sandbox_id, self._row_of(result.ranges)), True
            if result.succeeded:
                return True
            if row is not None and row.data.get("_w") == mark:
                return True  # an earlier attempt of this very write won; its answer was lost
        raise StoreConflict(f"sandbox {sandbox_id}: {MAX_CAS_ATTEMPTS} writes lost in a row")

    async def transition(
        self,
        sandbox_id: str,
        expected: SandboxState | Iterable[SandboxState],
        new: SandboxState,
        *,
        note: str | None = None,
        **changes: Any,
    ) -> bool:
        states = frozenset([expected] if isinstance(expected, SandboxState) else expected)
        moved = await self._rewrite(sandbox_id, states, new, changes, note=note)
        if moved and note is not None:
            await self._logged(sandbox_id)
        return moved

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

    async def _live_rows_seen(self) -> list[dict[str, Any]]:
        """The live rows as this replica knows them (`RowView.live_rows`) when it knows them
        all, else from etcd: for the reaper's scans, which act only after reading the row
        again. (A signed URL's lookup reads etcd: it may name a sandbox made a moment ago.)"""
        rows = self.rows.live_rows()
        return rows if rows is not None else await self._live_rows()

    async def envd_tokens(self) -> list[tuple[str, str]]:
        return [
            (str(r["id"]), str(r["envd_token"]))
            for r in await self._live_rows()
            if r.get("envd_token") is not None
        ]

    async def expired(self, now: float) -> list[SandboxRecord]:
        return [
            _record(r)
            for r in await self._live_rows_seen()
            if r["state"] == SandboxState.RUNNING.value and float(r["end_at"]) <= now
        ]

    async def next_deadline(self) -> float | None:
        ends = [
            float(r["end_at"])
            for r in await self._live_rows_seen()
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

    def _line(self, sandbox_id: str, message: str, level: str) -> tuple[bytes, bytes]:
        """A log line's key and value."""
        ns = time.time_ns()
        self._log_n += 1
        part = f"{ns:020d}-{self._writer}-{self._log_n:012d}"
        key = self.etcd.key("sandbox-logs", sandbox_id, part)
        return key, _dumps({"ts": ns / 1e9, "level": level, "message": message})

    def _note_ops(self, sandbox_id: str, note: str | None) -> list[Any]:
        # A note goes in the row's own transaction: one write (a raft round on every member)
        # instead of two.
        return [] if note is None else [put_op(*self._line(sandbox_id, note, "info"))]

    async def log(self, sandbox_id: str, message: str, level: str = "info") -> None:
        if not _part_ok(sandbox_id):
            raise ValueError(f"sandbox id {sandbox_id!r}: not a valid key part")
        await self.etcd.put(*self._line(sandbox_id, message, level))
        await self._logged(sandbox_id)

    async def _logged(self, sandbox_id: str) -> None:
        """One more line of this sandbox's written: every `_TRIM_EVERY`, the oldest past
        `MAX_LOG_LINES` go."""
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
