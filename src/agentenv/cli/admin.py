"""`aenv keys` and `aenv teams`: API keys and teams of the local server, run on the server
host against its store (SQLite file or etcd). Split from `client.py`: these commands open the
server's store, not its HTTP API."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Annotated, Any, TypeVar

import typer

from agentenv.cli.connection import ClientError, _fail, _guard, err
from agentenv.cli.output import emit
from agentenv.config import Settings

keys_app = typer.Typer(help="API keys of the local server (run on the server host).")
teams_app = typer.Typer(
    help="Teams of the local server and their limits (run on the server host).",
    no_args_is_help=True,
)

T = TypeVar("T")


# -- keys (server side) ----------------------------------------------------------------------


def _keyring_run(fn: Callable[[Any], Awaitable[T]]) -> T:
    """`fn(keyring)` on the server's store (its SQLite file, or etcd with `AGENTENV_ETCD`),
    opened for this one call and closed after it."""
    from agentenv.api.keys import KeyRing
    from agentenv.api.server import db_path
    from agentenv.control.backend import open_store

    settings = Settings.from_env()
    path = db_path(settings)
    if not settings.etcd_endpoints and not path.exists():
        raise ClientError(f"no server database at {path}: start `aenv serve` once first")

    async def run() -> T:
        store = open_store(settings, path)
        try:
            return await fn(KeyRing(store))
        finally:
            await store.close()

    return asyncio.run(run())


@keys_app.command("create")
def keys_create(
    name: str = typer.Argument("key"),
    team: Annotated[
        str, typer.Option("--team", help="The team (id or name) the key acts for.")
    ] = "default",
) -> None:
    """Create an API key of a team; it is printed once and only its hash is stored."""
    key, secret = _guard(lambda: _team_call(lambda ring: ring.create(name, team)))
    err.print(f"created key {key.id} ({name}, team {team}); store it now, it is not shown again:")
    print(secret)


@keys_app.command("ls")
def keys_ls() -> None:
    """List API keys (ids, prefixes and teams, never the keys)."""

    async def listed(ring: Any) -> list[dict[str, Any]]:
        names = {t.id: t.name for t in await ring.teams()}
        return [
            {
                "id": k.id,
                "name": k.name,
                "team": names.get(k.team_id, k.team_id),
                "prefix": k.prefix + "…",
                "created": time.strftime("%Y-%m-%d %H:%M", time.localtime(k.created_at)),
                "revoked": "yes" if k.revoked_at else "",
            }
            for k in await ring.list()
        ]

    rows = _guard(lambda: _keyring_run(listed))
    emit(rows, [("ID", "id"), ("NAME", "name"), ("TEAM", "team"), ("PREFIX", "prefix"),
                 ("CREATED", "created"), ("REVOKED", "revoked")])  # fmt: skip


@keys_app.command("revoke")
def keys_revoke(key_id: str) -> None:
    """Revoke an API key; every request with it fails (401) from the next one on."""
    from agentenv.api.keys import UnknownKey

    def run() -> None:
        try:
            _keyring_run(lambda ring: ring.revoke(key_id))
        except UnknownKey as exc:
            raise ClientError(str(exc)) from exc

    _guard(run)
    err.print(f"revoked {key_id}")


# -- teams (server side) ---------------------------------------------------------------------


def _team_call(fn: Callable[[Any], Awaitable[T]]) -> T:
    """`fn(keyring)`, its refusals (unknown team, bad value) as one-line errors."""
    from agentenv.api.keys import TeamExists, UnknownTeam

    try:
        return _keyring_run(fn)
    except (UnknownTeam, TeamExists, ValueError) as exc:
        raise ClientError(str(exc)) from exc


def _limit(value: int) -> str:
    return str(value) if value > 0 else "none"


@teams_app.command("create")
def teams_create(name: str) -> None:
    """Create a team (no limits of its own until `aenv teams set-limits`)."""
    team = _guard(lambda: _team_call(lambda ring: ring.create_team(name)))
    err.print(f"created team {team.name} ({team.id}); add a key: aenv keys create --team {name}")


@teams_app.command("ls")
def teams_ls() -> None:
    """List teams and their limits."""

    async def listed(ring: Any) -> list[dict[str, Any]]:
        return [
            {
                "id": t.id,
                "name": t.name,
                "max_sandboxes": _limit(t.max_sandboxes),
                "creates_per_minute": _limit(t.creates_per_minute),
            }
            for t in await ring.teams()
        ]

    rows = _guard(lambda: _keyring_run(listed))
    emit(rows, [("ID", "id"), ("NAME", "name"), ("MAX SANDBOXES", "max_sandboxes"),
                 ("CREATES/MIN", "creates_per_minute")])  # fmt: skip


@teams_app.command("set-limits")
def teams_set_limits(
    team: str,
    max_sandboxes: Annotated[
        int | None,
        typer.Option("--max-sandboxes", help="Sandboxes running at once (0 = no limit)."),
    ] = None,
    creates_per_minute: Annotated[
        int | None,
        typer.Option("--creates-per-minute", help="Create rate (0 = no limit)."),
    ] = None,
) -> None:
    """Set a team's limits; a running server applies them from its next request."""
    if max_sandboxes is None and creates_per_minute is None:
        _fail("give --max-sandboxes and/or --creates-per-minute")
    found = _guard(
        lambda: _team_call(
            lambda ring: ring.set_limits(
                team, max_sandboxes=max_sandboxes, creates_per_minute=creates_per_minute
            )
        )
    )
    err.print(
        f"team {found.name}: max sandboxes {_limit(found.max_sandboxes)}, creates per minute "
        f"{_limit(found.creates_per_minute)}"
    )
