"""Importing the contract loads none of the node side (issue #22): no network, VM or storage
code, no pyroute2. Checked in a fresh interpreter, where nothing else has loaded them."""

from __future__ import annotations

import json
import subprocess
import sys

PROBE = (
    "import json, sys, agentenv.contract.runtime, agentenv.contract.egress; "
    "print(json.dumps(sorted(sys.modules)))"
)
NODE_SIDE = ("agentenv.network", "agentenv.node", "agentenv.vmm", "agentenv.snapshot",
             "agentenv.storage", "agentenv.template", "agentenv.oci", "pyroute2")  # fmt: skip


def test_importing_the_contract_loads_no_node_side_code() -> None:
    out = subprocess.run(
        [sys.executable, "-c", PROBE], check=True, capture_output=True, text=True, timeout=60
    ).stdout
    loaded = json.loads(out)
    assert "agentenv.contract.runtime" in loaded
    assert [m for m in loaded if m.startswith(NODE_SIDE)] == []
