"""API keys: random secrets shown once, stored only as SHA-256 hashes.

Keys are issued in E2B's format, ``e2b_`` + 40 lowercase hex digits (20 random bytes, as
e2b-dev/infra ``packages/shared/pkg/keys``): the JS SDK from 2.27 refuses, before sending
anything, any key that does not match ``^e2b_[0-9a-f]+$``. Keys issued earlier (``aenv_…``)
keep working: a key is looked up by the hash of the whole string, whatever its prefix.

Every key belongs to a team (E2B's teamID); what a key creates is its team's, and it sees
only its team's (`api.tenancy`). The first key, and every key from before teams, is the
`default` team's. `verify` asks the store on every request. SQLite is read each time, so a
revoked key fails on its next call, also when `aenv keys revoke` ran in another process;
etcd answers from a watched copy of the hashes (`control.etcd_keys`), where a revocation
made elsewhere holds within milliseconds.
"""

from __future__ import annotations

import builtins
import hashlib
import os
import secrets
from pathlib import Path

from agentenv.control.store import DEFAULT_TEAM, ApiKey, Store, Team

KEY_PREFIX = "e2b_"


class UnknownKey(ValueError):
    """An API key operation was asked for something that does not exist."""


class UnknownTeam(ValueError):
    """No team has that id or name."""


class TeamExists(ValueError):
    """A team of that name exists already."""


def hash_key(secret: str) -> str:
    # Keys carry 160 random bits, so a fast unsalted hash cannot be brute-forced.
    return hashlib.sha256(secret.encode()).hexdigest()


def key_file(home: Path) -> Path:
    return home / "api-key"


class KeyRing:
    def __init__(self, store: Store) -> None:
        self.store = store

    async def create(self, name: str, team: str = DEFAULT_TEAM) -> tuple[ApiKey, str]:
        """A new key of `team` (its id or name)."""
        found = await self.team(team)
        secret = KEY_PREFIX + secrets.token_hex(20)
        key = await self.store.add_key(
            "k" + secrets.token_hex(6),
            name,
            secret[: len(KEY_PREFIX) + 4],
            hash_key(secret),
            found.id,
        )
        return key, secret

    async def verify(self, secret: str) -> ApiKey | None:
        if not secret:
            return None
        key = await self.store.key_by_hash(hash_key(secret))
        if key is None or key.revoked_at is not None:
            return None
        return key

    async def list(self) -> list[ApiKey]:
        return await self.store.keys()

    async def revoke(self, key_id: str) -> None:
        if not await self.store.revoke_key(key_id):
            raise UnknownKey(f"no active API key with id {key_id!r}")

    # -- teams -------------------------------------------------------------------------------

    async def team(self, ref: str) -> Team:
        found = await self.store.team(ref)
        if found is None:
            raise UnknownTeam(f"no team with id or name {ref!r}")
        return found

    async def teams(self) -> builtins.list[Team]:
        return await self.store.teams()

    async def create_team(self, name: str) -> Team:
        if not name or len(name) > 64 or not name.isprintable():
            raise ValueError("a team name is 1-64 printable characters")
        if await self.store.team(name) is not None:
            raise TeamExists(f"team {name!r} exists already")
        return await self.store.add_team("t" + secrets.token_hex(6), name)

    async def set_limits(
        self, team: str, *, max_sandboxes: int | None = None, creates_per_minute: int | None = None
    ) -> Team:
        """Set a team's limits (0 = none); what is None stays as it is."""
        for label, value in (("max sandboxes", max_sandboxes), ("creates per minute",
                                                               creates_per_minute)):  # fmt: skip
            if value is not None and value < 0:
                raise ValueError(f"{label} cannot be negative (0 = no limit)")
        found = await self.team(team)
        await self.store.set_team_limits(
            found.id, max_sandboxes=max_sandboxes, creates_per_minute=creates_per_minute
        )
        return await self.team(found.id)

    async def ensure_initial(self, home: Path) -> Path | None:
        """On first start, create a key and write it to a 0600 file; returns the file if new.
        Of servers starting together on one empty store (replicas), one makes it."""
        if await self.store.keys():
            return None
        found = await self.team(DEFAULT_TEAM)
        secret = KEY_PREFIX + secrets.token_hex(20)
        made = await self.store.add_first_key(
            "k" + secrets.token_hex(6),
            "default",
            secret[: len(KEY_PREFIX) + 4],
            hash_key(secret),
            found.id,
        )
        if made is None:
            return None
        path = key_file(home)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(secret + "\n")
        os.chmod(path, 0o600)
        return path
