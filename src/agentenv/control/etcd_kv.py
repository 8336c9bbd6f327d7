"""What the parts of the etcd store share (`etcd_store.EtcdStore` is `EtcdTenancy` and
`EtcdKeys` over this base): the client, the one bounded compare-and-set loop, the errors, and
the encodings of key parts and values."""

from __future__ import annotations

import base64
import json
from collections.abc import Callable
from typing import Any

from agentenv.cluster.etcd import MAX_CAS_ATTEMPTS as MAX_CAS_ATTEMPTS
from agentenv.cluster.etcd import (
    CasConflict,
    Etcd,
    KeyValue,
    Op,
    cas,
)
from agentenv.control.store import (
    ACTIVE_STATES,
    BUILD_METADATA,
    DEFAULT_TEAM,
)


class StoreConflict(CasConflict):
    """A compare-and-set kept losing to other writers (`MAX_CAS_ATTEMPTS` in a row, or
    until its deadline: `cluster.etcd.cas`)."""


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

    async def open(self) -> None:
        """Nothing to begin: the client connects on its first call."""

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
        """`cluster.etcd.cas` on this store's client: True once `change`'s value is written
        (with `also(value)`'s operations in the same transaction), False when `change` said
        there was nothing to write (None); `StoreConflict` when it kept losing. `_rewrite` (a
        row that moves between keys) and `take_places` (a gate key) are the two loops with
        their own guard."""
        written = await cas(self.etcd, key, change, what, also=also, conflict=StoreConflict)
        return written is not None
