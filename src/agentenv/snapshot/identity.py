"""Giving a restored guest its own identity through envd `/init`.

Every clone of a snapshot wakes up with the snapshot's hostname, a wall clock stuck at the
capture and the same kernel RNG state as its siblings; this fixes all three.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from agentenv.guest.envd.client import EnvdClient

ENTROPY_BYTES = 64


async def identify(
    envd: EnvdClient,
    *,
    hostname: str,
    env_vars: Mapping[str, str] | None = None,
    access_token: str | None = None,
    default_user: str | None = None,
    default_workdir: str | None = None,
) -> None:
    """Through `envd`, a client to the restored guest carrying the token its envd already
    has (a capture of a sandbox that was initialised; the restore's health wait used the
    same client and connection). `access_token=""` clears the token."""
    await envd.init(
        hostname=hostname,
        entropy=os.urandom(ENTROPY_BYTES),
        env_vars=env_vars,
        access_token=access_token,
        default_user=default_user,
        default_workdir=default_workdir,
    )
