"""What the parts of the etcd store share (`etcd_store.EtcdStore` is `EtcdTenancy` and
`EtcdKeys` over this base): the client, the one bounded compare-and-set loop, the errors, and
the encodings of key parts and values."""

from __future__ import annotations

import base64
import json
from collections.abc import Callable
from typing import Any

from agentenv.cluster.etcd import (
    Etcd,
    KeyValue,
    Op,
    created_at,
    get_op,
    modified_at,
    put_op,
)
from agentenv.control.store import (
    ACTIVE_STATES,
    BUILD_METADATA,
    DEFAULT_TEAM,
)

# Compare-and-set attempts before giving up: each lost race means another writer won a write
# to the same key in between, so this many in a row is a bug or a runaway writer.
MAX_CAS_ATTEMPTS = 64


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


class EtcdKv:
    """The client and the compare-and-set loop."""

    def __init__(self, etcd: Etcd) -> None:
        self.etcd = etcd

    async def close(self) -> None:
        await self.etcd.close()

    async def _live_rows(self) -> list[dict[str, Any]]:
        """Every live sandbox row (kept by `EtcdStore`); admission counts them."""
        raise NotImplementedError

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
