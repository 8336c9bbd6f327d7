"""Running the JS SDK's scenario scripts (tests/e2e/js/*.mjs) against a live server.

A scenario runs in its own node process (`node <script> <scenario> [args]`) with the
server's E2B_API_URL / E2B_SANDBOX_URL / E2B_API_KEY; the script asserts, prints
`OK <scenario>` and exits 0, or prints why not and exits non-zero (tests/e2e/js/lib.mjs).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from jsdeps import JS_DIR, ensure_js_sdk

from agentenv.api.devserver import ServerProcess

# One scenario's node process; the scripts' own deadlines (lib.mjs) are shorter.
NODE_TIMEOUT_S = 480


@dataclass
class JsEnv:
    server: ServerProcess
    workdir: Path
    run_id: str


def js_workdir(work: Path) -> Path:
    """`work` made ready to run the scripts: ESM resolves `e2b` from the script's own
    directory, so the scripts run from a copy next to a link to the cached install (the
    source tree gets no node_modules)."""
    node_modules = ensure_js_sdk()
    for script in JS_DIR.glob("*.mjs"):
        shutil.copy2(script, work / script.name)
    shutil.copy2(JS_DIR / "package.json", work / "package.json")
    (work / "node_modules").symlink_to(node_modules)
    return work


def node(
    js: JsEnv, script: str, scenario: str, *args: str, timeout_s: float = NODE_TIMEOUT_S
) -> str:
    """Run one scenario; its output is printed (shown by pytest on failure, or with -s)."""
    env = {**os.environ, **js.server.sdk_env(), "AGENTENV_JS_RUN": js.run_id}
    started = time.monotonic()
    try:
        proc = subprocess.run(
            ["node", script, scenario, *args],
            cwd=js.workdir,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired as exc:
        raw = exc.stdout or ""
        out = raw.decode(errors="replace") if isinstance(raw, bytes) else raw
        pytest.fail(f"node {script} {scenario} still running after {timeout_s} s:\n{out}")
    took = time.monotonic() - started
    print(f"node {script} {scenario} ({took:.1f} s, exit {proc.returncode}):\n{proc.stdout}")
    if proc.stderr.strip():
        print(f"stderr:\n{proc.stderr}")
    assert proc.returncode == 0, (
        f"node {script} {scenario} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr[-3000:]}"
    )
    assert f"OK {scenario}" in proc.stdout, proc.stdout
    return proc.stdout
