"""The official E2B SDK, unmodified, against `aenv serve` booting real microVMs.

Two legs, each a run of `sdk_scenarios.py` in its own interpreter:

- ``latest``: the pinned current SDK (``e2b==2.63.0``, the project venv): v2 create/connect.
- ``v1``: ``e2b==2.50.0`` in a venv cached under ``~/.cache/agentenv/venvs/e2b-2.50.0``
  (created on first use with ``python -m venv`` + pip): the last release that creates with
  the v1 ``POST /sandboxes`` (with ``secure``) and connects (also resumes) with the v1
  ``POST /sandboxes/{id}/connect``; 2.51 moved both to ``/v2``. The same scenarios but the
  100 MB upload, then the pause/snapshot/fork/auto-pause ones of sdk_snapshot_scenarios.py.

Each leg runs once per module (a handful of VMs, never more than two at a time, but the
two-child fork) and every scenario is reported as its own test.
"""

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
OLD_SDK = "2.50.0"
LATEST_SCENARIOS = [
    "create_and_info", "run_output", "env_cwd_user", "streaming", "background_child",
    "background_kill", "stdin", "pty", "files", "watch", "big_file", "connect_by_id",
    "secure_token", "user_servers", "metrics", "list_and_kill", "error_hygiene",
    "set_timeout_expiry",
]  # fmt: skip
V1_SCENARIOS = [name for name in LATEST_SCENARIOS if name != "big_file"]
# The snapshot scenarios through 2.50: resume by the v1 connect, create from a snapshot and
# auto-pause settings by the v1 create (sdk_snapshot_scenarios.py, leg `v1`).
V1_SNAPSHOT_SCENARIOS = [
    "pause_and_connect",
    "persistent_snapshot",
    "fork_two",
    "auto_pause_then_connect",
]


def sdk_venv(version: str) -> Path:
    """A venv with only `e2b==version` (and websockets), keyed by the version, reused."""
    root = Path(os.environ.get("AGENTENV_CACHE", Path.home() / ".cache" / "agentenv"))
    venv = root / "venvs" / f"e2b-{version}"
    python = venv / "bin" / "python"
    marker = venv / ".complete"
    if not marker.exists():
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
        subprocess.run(
            [str(python), "-m", "pip", "install", "-q", f"e2b=={version}", "websockets>=13"],
            check=True,
            timeout=900,
        )
        marker.write_text(version)
    return python


@pytest.fixture(scope="module")
def vm_server(tmp_path_factory: pytest.TempPathFactory) -> Any:

    home = tmp_path_factory.mktemp("sdk-home")
    prepare_home(home)
    srv = ServerProcess(home, domain="sbx.test", ready_timeout_s=180).start()
    try:
        yield srv
    finally:
        srv.stop(timeout_s=120)


def run_leg(
    server: ServerProcess,
    python: Path | str,
    leg: str,
    out: Path,
    script: str = "sdk_scenarios.py",
    extra: tuple[str, ...] = (),
) -> dict[str, Any]:
    env = {**os.environ, **server.sdk_env(), "AGENTENV_TEST_DOMAIN": "sbx.test"}
    proc = subprocess.run(
        [str(python), str(HERE / script), "--leg", leg, "--out", str(out), *extra],
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert out.exists(), f"scenario run crashed ({proc.returncode}): {proc.stderr[-3000:]}"
    data: dict[str, Any] = json.loads(out.read_text())
    print(f"{script} {leg} timings: {data['timings']}")
    return data


@pytest.fixture(scope="module")
def latest_results(vm_server: ServerProcess, tmp_path_factory: pytest.TempPathFactory) -> Any:
    out = tmp_path_factory.mktemp("sdk-latest") / "results.json"
    return run_leg(vm_server, sys.executable, "latest", out)


@pytest.fixture(scope="module")
def v1_results(vm_server: ServerProcess, tmp_path_factory: pytest.TempPathFactory) -> Any:
    out = tmp_path_factory.mktemp("sdk-v1") / "results.json"
    return run_leg(vm_server, sdk_venv(OLD_SDK), "v1", out)


@pytest.fixture(scope="module")
def v1_snapshot_results(
    vm_server: ServerProcess, v1_results: Any, tmp_path_factory: pytest.TempPathFactory
) -> Any:
    work = tmp_path_factory.mktemp("sdk-v1-snap")
    state = ("--state", str(work / "held.json"))
    python = sdk_venv(OLD_SDK)
    return run_leg(
        vm_server, python, "v1", work / "results.json", "sdk_snapshot_scenarios.py", state
    )


def _assert_scenario(results: dict[str, Any], name: str) -> None:
    by_name = {r["scenario"]: r for r in results["results"]}
    assert name in by_name, f"scenario {name} did not run"
    r = by_name[name]
    assert r["ok"], f"{name}: {r.get('error')}\n{r.get('trace', '')}"


@pytest.mark.parametrize("name", LATEST_SCENARIOS)
def test_sdk_latest(latest_results: dict[str, Any], name: str) -> None:
    _assert_scenario(latest_results, name)


@pytest.mark.parametrize("name", V1_SCENARIOS)
def test_sdk_v1(v1_results: dict[str, Any], name: str) -> None:
    _assert_scenario(v1_results, name)


@pytest.mark.parametrize("name", V1_SNAPSHOT_SCENARIOS)
def test_sdk_v1_snapshots(v1_snapshot_results: dict[str, Any], name: str) -> None:
    _assert_scenario(v1_snapshot_results, name)


def test_server_log_names_sandboxes(vm_server: ServerProcess, latest_results: Any) -> None:
    log = vm_server.log_tail(2000)
    assert "creating template=base" in log and "running address=198.18." in log
    assert "Traceback" not in log, log[-3000:]
