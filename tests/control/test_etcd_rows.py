"""What a replica knows of the sandbox rows (`control/etcd_rows.RowView`): only a newer
revision replaces what it knows, a deletion is known as one, and nothing is `current` while
the watch is not in step. The watch itself on a real etcd: tests/control/test_store.py."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from agentenv.cluster.etcd import KeyValue
from agentenv.control import etcd_rows
from agentenv.control.etcd_rows import RowView

PREFIX = b"/p/sandboxes/"


def _kv(sandbox_id: str, state: str, revision: int, where: bytes = PREFIX) -> KeyValue:
    value = json.dumps({"id": sandbox_id, "state": state}).encode()
    return KeyValue(where + sandbox_id.encode(), value, 1, revision, 0)


def _view() -> RowView:
    view = RowView(None, PREFIX, lambda key: key.rsplit(b"/", 1)[-1].decode())  # type: ignore[arg-type]
    # As once its watch runs: the rows listed, the stream open.
    view._in_step, view._watch = True, SimpleNamespace(streaming=True)  # type: ignore[assignment]
    return view


def test_only_a_newer_revision_replaces_a_row() -> None:
    view = _view()
    view.learn("i1", _kv("i1", "running", 10))
    view.learn("i1", _kv("i1", "paused", 8))  # a late watch event
    row = view.current("i1")
    assert row is not None and (row.state, row.kv.mod_revision) == ("running", 10)
    assert row.data["seq"] == 1  # the create revision, as the store numbers rows
    view.learn("i1", _kv("i1", "paused", 11))
    row = view.current("i1")
    assert row is not None and row.state == "paused"


def test_a_deleted_live_row_is_not_current_and_stays_deleted() -> None:
    view = _view()
    view.learn("i1", _kv("i1", "running", 10))
    view.learn("i1", None, 12)  # the live key went at 12 (moved to gone-sandboxes/)
    assert view.current("i1") is None and view.latest("i1") is None
    view.learn("i1", _kv("i1", "running", 11))  # an event from before the delete, late
    assert view.current("i1") is None
    # A gone row read at the move's revision: known (a write starts from it), never current.
    view.learn("i1", _kv("i1", "gone", 12, b"/p/gone-sandboxes/"))
    latest = view.latest("i1")
    assert latest is not None and latest.state == "gone" and view.current("i1") is None


def test_out_of_step_nothing_is_current() -> None:
    view = _view()
    view.learn("i1", _kv("i1", "running", 10))
    view._watch.streaming = False  # type: ignore[union-attr,misc]  # broken, opening again
    assert view.current("i1") is None
    view._watch, view._in_step = None, False  # listing again
    assert view.current("i1") is None
    latest = view.latest("i1")
    assert latest is not None and latest.state == "running"
    view.forget("i1")
    assert view.latest("i1") is None


def test_live_rows_only_while_every_live_row_is_known(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(etcd_rows, "MAX_ROWS", 3)
    monkeypatch.setattr(etcd_rows, "MAX_PAST", 2)
    view = _view()
    view._complete = True  # as after a listing that fit
    view.learn("i1", _kv("i1", "running", 10))
    view.learn("i2", _kv("i2", "paused", 11))
    # Sandboxes that came and went, more than the room for them: the live rows stay known.
    for n in range(5):
        view.learn(f"g{n}", _kv(f"g{n}", "running", 12 + 2 * n))
        view.learn(f"g{n}", None, 13 + 2 * n)
    view.learn("i3", _kv("i3", "gone", 30, b"/p/gone-sandboxes/"))
    rows = view.live_rows()
    assert rows is not None and sorted(r["id"] for r in rows) == ["i1", "i2"]
    view.learn("i4", _kv("i4", "running", 31))
    assert view.live_rows() is not None
    view.learn("i5", _kv("i5", "running", 32))  # no room: i1 goes, a live row
    assert view.live_rows() is None and view.current("i1") is None
    view._watch.streaming = False  # type: ignore[union-attr,misc]
    view._complete = True
    assert view.live_rows() is None
