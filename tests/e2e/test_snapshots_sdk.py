"""The E2B SDK's snapshot scenarios against `aenv serve` on real microVMs, with a server
restart (SIGTERM, start) between a pause and the resume."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from agentenv.api.devserver import ServerProcess
from agentenv.template.datadir import prepare_home

pytestmark = pytest.mark.vm

HERE = Path(__file__).parent
BEFORE = [
    "pause_and_connect",
    "ten_cycles",
    "persistent_snapshot",
    "fork_eight",
    "auto_pause_then_connect",
    "leave_paused",
]


def run_leg(server: ServerProcess, leg: str, out: Path, state: Path) -> dict[str, Any]:
    env = {**os.environ, **server.sdk_env(), "AGENTENV_TEST_DOMAIN": "sbx.test"}
    cmd = [sys.executable, str(HERE / "sdk_snapshot_scenarios.py"), "--leg", leg]
    proc = subprocess.run(
        [*cmd, "--out", str(out), "--state", str(state)],
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert out.exists(), f"scenario run crashed ({proc.returncode}): {proc.stderr[-3000:]}"
    data: dict[str, Any] = json.loads(out.read_text())
    print(f"{leg} timings: {data['timings']}")
    return data


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:

    home = tmp_path_factory.mktemp("sdk-snap-home")
    work = tmp_path_factory.mktemp("sdk-snap")
    prepare_home(home)
    state = work / "held.json"
    srv = ServerProcess(home, domain="sbx.test", ready_timeout_s=180).start()
    try:
        before = run_leg(srv, "before", work / "before.json", state)
    finally:
        srv.stop(timeout_s=120)
    srv = ServerProcess(home, domain="sbx.test", ready_timeout_s=180).start()
    try:
        after = run_leg(srv, "after", work / "after.json", state)
        log = srv.log_tail(3000)
    finally:
        srv.stop(timeout_s=120)
    return {r["scenario"]: r for r in before["results"] + after["results"]} | {"log": log}


@pytest.mark.parametrize("name", [*BEFORE, "resume_after_restart"])
def test_sdk_snapshot_scenario(results: dict[str, Any], name: str) -> None:
    assert name in results, f"scenario {name} did not run"
    r = results[name]
    assert r["ok"], f"{name}: {r.get('error')}\n{r.get('trace', '')}"
