"""API keys: random secrets shown once, stored only as SHA-256 hashes.

Keys are issued in E2B's format, ``e2b_`` + 40 lowercase hex digits (20 random bytes, as
e2b-dev/infra ``packages/shared/pkg/keys``): the JS SDK from 2.27 refuses, before sending
anything, any key that does not match ``^e2b_[0-9a-f]+$``. Keys issued earlier (``aenv_…``)
keep working: a key is looked up by the hash of the whole string, whatever its prefix.
"""

from __future__ import annotations

import hashlib
import os
import secrets
from pathlib import Path

from agentenv.orchestrator.store import ApiKey, Store

KEY_PREFIX = "e2b_"


class UnknownKey(ValueError):
    """An API key operation was asked for something that does not exist."""


def hash_key(secret: str) -> str:
    # Keys carry 160 random bits, so a fast unsalted hash cannot be brute-forced.
    return hashlib.sha256(secret.encode()).hexdigest()


def key_file(home: Path) -> Path:
    return home / "api-key"


class KeyRing:
    def __init__(self, store: Store) -> None:
        self.store = store

    def create(self, name: str) -> tuple[ApiKey, str]:
        secret = KEY_PREFIX + secrets.token_hex(20)
        key = self.store.add_key(
            "k" + secrets.token_hex(6), name, secret[: len(KEY_PREFIX) + 4], hash_key(secret)
        )
        return key, secret

    def verify(self, secret: str) -> ApiKey | None:
        if not secret:
            return None
        key = self.store.key_by_hash(hash_key(secret))
        if key is None or key.revoked_at is not None:
            return None
        return key

    def list(self) -> list[ApiKey]:
        return self.store.keys()

    def revoke(self, key_id: str) -> None:
        if not self.store.revoke_key(key_id):
            raise UnknownKey(f"no active API key with id {key_id!r}")

    def ensure_initial(self, home: Path) -> Path | None:
        """On first start, create a key and write it to a 0600 file; returns the file if new."""
        if self.store.keys():
            return None
        _, secret = self.create("default")
        path = key_file(home)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(secret + "\n")
        os.chmod(path, 0o600)
        return path
