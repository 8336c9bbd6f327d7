"""Two servers on one etcd (`AGENTENV_ETCD`): the control plane's state is the etcd store's, not
either server's. A key the first server made works on the second, `aenv keys`/`aenv teams`
(pointed at the same etcd) change what both answer from the next request on, and neither
writes a SQLite file. No node agent joins and no sandbox is made (no VM boots).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from cluster.etcd_cluster import EtcdCluster

from agentenv.api.devserver import ServerProcess
from agentenv.template.datadir import prepare_home

from .conftest import stop_and_check

pytestmark = pytest.mark.vm


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdCluster]:
    with EtcdCluster(tmp_path_factory.mktemp("etcd"), size=1) as cluster:
        yield cluster


def _aenv(env: dict[str, str], home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if not k.startswith(("E2B_", "AGENTENV_"))}
    full.update(env, AGENTENV_HOME=str(home))
    return subprocess.run(
        [sys.executable, "-m", "agentenv.cli", *args],
        env=full,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def _status(server: ServerProcess, key: str) -> int:
    with httpx.Client(base_url=server.url, timeout=30) as client:
        return client.get("/v2/sandboxes", headers={"X-API-Key": key}).status_code


def test_two_servers_share_keys_and_teams_through_etcd(
    etcd: EtcdCluster, tmp_path_factory: pytest.TempPathFactory
) -> None:
    env = {
        "AGENTENV_ETCD": etcd.endpoints,
        "AGENTENV_ETCD_PREFIX": f"/agentenv-test-{uuid.uuid4().hex[:8]}/",
        # With AGENTENV_ETCD a server is a cluster control plane: its sandboxes run on node
        # agents (none here), which it reaches with this token.
        "AGENTENV_NODE_TOKEN": "test-node-token-" + uuid.uuid4().hex,
        # No warm pool: nothing here boots a VM.
        "AGENTENV_WARM_LOW": "0",
        "AGENTENV_WARM_HIGH": "0",
    }
    first = ServerProcess(prepare_home(tmp_path_factory.mktemp("first")), env=env)
    second = ServerProcess(prepare_home(tmp_path_factory.mktemp("second")), env=env)
    first.start()
    try:
        second.start()
        try:
            # The first server made the store's first key; the second found keys there.
            key = first.api_key
            assert not (second.home / "api-key").exists()
            assert _status(first, key) == 200 and _status(second, key) == 200
            assert _status(second, "e2b_" + "0" * 40) == 401
            # The operator's commands write to the same store.
            r = _aenv(env, second.home, "teams", "create", "bravo")
            assert r.returncode == 0, r.stderr
            r = _aenv(env, second.home, "keys", "create", "bob", "--team", "bravo")
            assert r.returncode == 0, r.stderr
            bob = r.stdout.strip()
            assert _status(first, bob) == 200 and _status(second, bob) == 200
            (row,) = [k for k in _keys(env, first.home) if k["name"] == "bob"]
            r = _aenv(env, first.home, "keys", "revoke", row["id"])
            assert r.returncode == 0, r.stderr
            assert _status(first, bob) == 401 and _status(second, bob) == 401
            assert _status(second, key) == 200
            # Nothing of it in a server's own data dir.
            for server in (first, second):
                assert not (server.home / "agentenv.db").exists()
        finally:
            stop_and_check(second)
    finally:
        stop_and_check(first)


def _keys(env: dict[str, str], home: Path) -> list[dict[str, str]]:
    r = _aenv(env, home, "keys", "ls")
    assert r.returncode == 0, r.stderr
    rows: list[dict[str, str]] = json.loads(r.stdout)
    return rows
