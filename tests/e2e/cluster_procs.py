"""Many nodes on one machine, as separate processes: node agents (`aenv node`, each with its own
data dir, slot range, id and RPC port), control-plane replicas (`ServerProcess` with
`AGENTENV_ETCD`), and the etcd harness of tests/cluster. Every process is the test's own and is
stopped (or killed) by PID."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from agentenv.api.devserver import OwnProcess, ServerProcess, free_port
from agentenv.template.datadir import prepare_home

NODE_READY_S = 120.0


class NodeProcess(OwnProcess):
    def __init__(self, home: Path, node_id: str, slot_cidr: str, env: dict[str, str]) -> None:
        self.home = home
        self.node_id = node_id
        self.slot_cidr = slot_cidr
        self.port = free_port()
        self.env = env
        self.log_path = home / "node.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> NodeProcess:
        prepare_home(self.home)
        env = {
            **os.environ,
            **self.env,
            "AGENTENV_HOME": str(self.home),
            "AGENTENV_NODE_ID": self.node_id,
            "AGENTENV_NODE_BIND": f"127.0.0.1:{self.port}",
            "AGENTENV_SLOT_CIDR": self.slot_cidr,
        }
        # A restart appends to the same log: only what this run writes says it is ready.
        offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "agentenv.cli", "node"],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        deadline = time.monotonic() + NODE_READY_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"node {self.node_id} exited: {self.log_tail()}")
            if f"node {self.node_id} serving at" in self._log_since(offset):
                return self
            time.sleep(0.1)
        self.crash()
        raise RuntimeError(f"node {self.node_id} not ready in {NODE_READY_S:.0f} s")

    def stop(self, timeout_s: float = 120.0) -> int | None:
        return super().stop(timeout_s)

    def _log_since(self, offset: int) -> str:
        with open(self.log_path, "rb") as log:
            log.seek(offset)
            return log.read().decode(errors="replace")


def cluster_env(endpoints: str, token: str, prefix: str) -> dict[str, str]:
    """What every process of one test cluster shares."""
    return {
        "AGENTENV_ETCD": endpoints,
        "AGENTENV_ETCD_PREFIX": prefix,
        "AGENTENV_NODE_TOKEN": token,
        # Short leases, so a killed agent (or replica) is seen gone within seconds.
        "AGENTENV_NODE_TTL_S": "4",
        "AGENTENV_REPLICA_TTL_S": "4",
        # No background QEMUs: 2 cores run 3 nodes' guests.
        "AGENTENV_WARM_LOW": "0",
        "AGENTENV_WARM_HIGH": "0",
    }


def replica(home: Path, env: dict[str, str]) -> ServerProcess:
    return ServerProcess(home, env=env, ready_timeout_s=180)
