"""Teams and their limits, snapshot owners, and the admission state every replica shares
(create-rate buckets, held places) in etcd: a part of `etcd_store.EtcdStore`."""

from __future__ import annotations

import dataclasses
import json
import math
import secrets
import time

from agentenv.cluster.etcd import (
    KeyValue,
    created_at,
    get_op,
    modified_at,
    put_op,
)
from agentenv.control.etcd_kv import (
    MAX_CAS_ATTEMPTS,
    DuplicateKey,
    EtcdKv,
    StoreConflict,
    _active_ends,
    _b64,
    _dumps,
    _part_ok,
)
from agentenv.control.store import (
    DEFAULT_TEAM,
    Team,
)


class EtcdTenancy(EtcdKv):
    _default_team_ready = False

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
