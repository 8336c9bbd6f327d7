"""What one control-plane replica knows of the sandbox rows in etcd without asking it.

Every request the proxy carries names a sandbox, and the proxy needs its row (where it runs,
its state, its tokens): reading it from etcd each time cost a transaction per request, on the
replica (gRPC, protobuf) and on etcd (a linearizable read goes through the leader). This
view keeps the live rows (`sandboxes/`) as a watch on that prefix delivers them, plus every
row this replica reads or writes itself, at once. Each entry carries the etcd revision it is
from and only a newer one replaces it, so a late watch event never undoes a newer read.

What it is for, and what not:
- `current`: the row as this replica knows it while the watch is in step (a change another
  replica made arrives a few milliseconds later). The proxy forwards on a running row from
  here and reads etcd for any other state; None means "not known here": read etcd.
- `latest`: the starting point of a compare-and-set (`EtcdStore._rewrite`), whose compare
  decides; never an answer on its own.
Values are kept as etcd's bytes and decoded on use: a replica may know thousands of rows.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from agentenv.cluster.etcd import Etcd, KeyValue, WatchEvent
from agentenv.cluster.mirror import PrefixFollower

# Live rows remembered (etcd's bytes, ~1 KB each); past this the least recently learned go,
# and a row not known here is read from etcd.
MAX_ROWS = 16384
# Rows that went (deleted live keys, gone rows read): kept apart, so that a churn of short
# sandboxes does not push long-lived rows out. They stop a read answered before a deletion
# from bringing the deleted row back; seconds would do.
MAX_PAST = 4096


@dataclass
class Row:
    """A sandbox row as read: where it is, at which revision, and its fields (with `seq`)."""

    key: bytes
    kv: KeyValue
    data: dict[str, Any]

    @property
    def state(self) -> str:
        return str(self.data["state"])


def decode(kv: KeyValue) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(kv.value)
    data.setdefault("seq", kv.create_revision)
    return data


@dataclass
class _Known:
    revision: int
    # The row's key-value, or None: its live key was deleted at `revision` (it went).
    kv: KeyValue | None


class RowView(PrefixFollower):
    """Live sandbox rows under `prefix` (the store's `sandboxes/` directory), kept by a watch
    (`start`, `cluster.mirror.PrefixFollower`) and by the store's own reads and writes
    (`learn`)."""

    def __init__(self, etcd: Etcd, prefix: bytes, id_of: Callable[[bytes], str]) -> None:
        super().__init__(etcd, prefix, "sandbox rows")
        self._prefix = prefix
        self._id_of = id_of
        self._live: OrderedDict[str, _Known] = OrderedDict()
        self._past: OrderedDict[str, _Known] = OrderedDict()
        # Every live row is known (none dropped for room since the last listing).
        self._complete = False

    # -- what the store learns itself ----------------------------------------------------------

    def learn(self, sandbox_id: str, kv: KeyValue | None, revision: int = 0) -> None:
        """A row read or written at `kv.mod_revision` (live or gone key); None with the
        revision its live key was deleted at. Older than what is known: ignored."""
        rev = kv.mod_revision if kv is not None else revision
        known = self._known(sandbox_id)
        if known is not None and known.revision > rev:
            return
        entry = _Known(rev, kv)
        self.forget(sandbox_id)
        live = self._is_live(entry)
        table = self._live if live else self._past
        table[sandbox_id] = entry
        if len(table) > (MAX_ROWS if live else MAX_PAST):
            table.popitem(last=False)
            if live:
                # A live row is no longer known here: the view holds only some of them
                # until the next listing.
                self._complete = False

    def _known(self, sandbox_id: str) -> _Known | None:
        return self._live.get(sandbox_id) or self._past.get(sandbox_id)

    def _is_live(self, known: _Known) -> bool:
        return known.kv is not None and known.kv.key.startswith(self._prefix)

    def forget(self, sandbox_id: str) -> None:
        self._live.pop(sandbox_id, None)
        self._past.pop(sandbox_id, None)

    def latest(self, sandbox_id: str) -> Row | None:
        """The newest version of the row known here, whether or not the watch is in step."""
        known = self._known(sandbox_id)
        if known is None or known.kv is None:
            return None
        return Row(known.kv.key, known.kv, decode(known.kv))

    def current(self, sandbox_id: str) -> Row | None:
        """The live row as known here while the watch is in step; None when not known."""
        if not self.in_step:
            return None
        row = self.latest(sandbox_id)
        return row if row is not None and row.key.startswith(self._prefix) else None

    def live_rows(self) -> list[dict[str, Any]] | None:
        """Every live row's fields while the watch is in step and none was dropped for
        room; None otherwise (list them from etcd)."""
        if not (self.in_step and self._complete):
            return None
        return [decode(k.kv) for k in self._live.values() if k.kv is not None]

    # -- the watch (`PrefixFollower`) ----------------------------------------------------------

    def _listed(self, kvs: list[KeyValue], revision: int) -> None:
        self._complete = len(kvs) <= MAX_ROWS
        listed = {self._id_of(kv.key) for kv in kvs}
        for kv in kvs:
            self.learn(self._id_of(kv.key), kv)
        # Rows known live that the listing no longer has went before `revision`.
        for sandbox_id in [i for i in self._live if i not in listed]:
            self.learn(sandbox_id, None, revision)

    def _changed(self, event: WatchEvent) -> None:
        sandbox_id = self._id_of(event.kv.key)
        if event.kind == "put":
            self.learn(sandbox_id, event.kv)
        else:
            self.learn(sandbox_id, None, event.kv.mod_revision)
