"""Which store a server uses: `open_store` picks etcd when the settings list members, else the
single-node SQLite file. Its own module so `store` (the protocol and `SqliteStore`) and
`etcd_store` (which builds on `store`'s types) do not import each other.
"""

from __future__ import annotations

from pathlib import Path

from agentenv.config import Settings
from agentenv.control.sqlite_store import SqliteStore
from agentenv.control.store import Store


def open_store(settings: Settings, db: Path) -> Store:
    """The store this server's settings name: etcd when `AGENTENV_ETCD` lists members (shared
    by every control-plane replica), else the SQLite file `db` (the single-node default).
    Nothing connects yet: the etcd client opens its channels on the first call, in the event
    loop that makes it, so this may run before the server's loop starts."""
    if settings.etcd_endpoints:
        from agentenv.cluster.etcd import Etcd  # grpc, loaded only for a cluster
        from agentenv.control.etcd_store import EtcdStore

        return EtcdStore(Etcd.from_settings(settings))
    return SqliteStore(db)
