"""Paging and filter parameters of the list routes, in E2B's wire forms: keyset tokens for
sandboxes (time + id), offset tokens for snapshots and template builds, state, metadata and
time filters. Every bad value is a `BadRequest` naming it."""

from __future__ import annotations

import base64
from datetime import datetime
from urllib.parse import parse_qsl, unquote

from agentenv.api import views
from agentenv.contract.errors import BadRequest

# The largest page a list route returns (E2B's limit).
MAX_PAGE = 100


def parse_states(raw: list[str]) -> set[str]:
    values = {s.strip() for item in raw for s in item.split(",") if s.strip()}
    if not values:
        return {"running", "paused"}
    bad = values - {"running", "paused"}
    if bad:
        raise BadRequest(f"unknown state filter {sorted(bad)[0]!r}: use running or paused")
    return values


def parse_metadata(raw: str | None, *, encoded_twice: bool) -> dict[str, str]:
    """Decode the SDK's metadata filter (v2: ``urlencode({quote(k): quote(v)})``, sent encoded)."""
    if not raw:
        return {}
    pairs = parse_qsl(raw, keep_blank_values=True)
    if encoded_twice:
        return {unquote(k): unquote(v) for k, v in pairs}
    return dict(pairs)


def parse_time(raw: str) -> int:
    """``startedAfter`` in microseconds since the epoch (finer digits are dropped, as E2B's
    truncation; no offset means UTC)."""
    try:
        return views.micros_of(datetime.fromisoformat(raw.replace("Z", "+00:00")))
    except ValueError as exc:
        raise BadRequest(f"startedAfter {raw!r} is not an ISO-8601 time") from exc


def encode_token(us: int, sandbox_id: str, desc: bool) -> str:
    # E2B's cursor: base64url("{RFC 3339 time}__{id}"), plus "__asc" for ascending pages.
    raw = f"{views.iso_micros(us)}__{sandbox_id}" + ("" if desc else "__asc")
    return base64.urlsafe_b64encode(raw.encode()).decode()


def decode_token(token: str, desc: bool) -> tuple[int, str]:
    """The (start time, id) a page continues after; the token must be for this order."""
    try:
        raw = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4)).decode()
        parts = raw.split("__")
        if len(parts) not in (2, 3) or (len(parts) == 3 and parts[2] != "asc") or not parts[1]:
            raise ValueError(raw)
        us = views.micros_of(datetime.fromisoformat(parts[0].replace("Z", "+00:00")))
    except ValueError as exc:
        raise BadRequest("nextToken is not a token this server issued") from exc
    if (len(parts) == 2) != desc:
        raise BadRequest(
            f"nextToken was issued for order={'desc' if len(parts) == 2 else 'asc'}, "
            f"not order={'desc' if desc else 'asc'}"
        )
    return us, parts[1]


def encode_offset(offset: int) -> str:
    return base64.urlsafe_b64encode(f"seq:{offset}".encode()).decode().rstrip("=")


def decode_offset(token: str) -> int:
    try:
        raw = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4)).decode()
        kind, _, offset = raw.partition(":")
        if kind != "seq":
            raise ValueError(raw)
        return int(offset)
    except ValueError as exc:
        raise BadRequest("nextToken is not a token this server issued") from exc
