"""Sandbox-wide settings that `/init` changes: env vars, access token, default user and workdir."""

from __future__ import annotations

import hmac
from dataclasses import dataclass, field


@dataclass
class EnvdState:
    default_user: str = "user"
    default_workdir: str | None = None
    env_vars: dict[str, str] = field(default_factory=dict)
    access_token: str | None = None
    guest: bool = False

    def token_ok(self, presented: str | None) -> bool:
        if not self.access_token:
            return True
        if presented is None:
            return False
        return hmac.compare_digest(presented.encode(), self.access_token.encode())
