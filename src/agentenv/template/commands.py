"""Running host commands for builds, with failures turned into one-line BuildErrors."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path

from agentenv.template.errors import BuildError


def run(
    cmd: Sequence[str | Path],
    *,
    cwd: Path | None = None,
    env: Mapping[str, str] | None = None,
    input_bytes: bytes | None = None,
    timeout: float | None = 3600,
) -> str:
    """Run a command to completion and return its stdout; raise BuildError on failure."""
    args = [str(a) for a in cmd]
    full_env = dict(os.environ)
    if env:
        full_env.update(env)
    try:
        proc = subprocess.run(
            args,
            cwd=cwd,
            env=full_env,
            input=input_bytes,
            capture_output=True,
            timeout=timeout,
            check=False,
        )
    except FileNotFoundError as exc:
        raise BuildError(f"{args[0]}: command not found (run `aenv setup`)") from exc
    except subprocess.TimeoutExpired as exc:
        raise BuildError(f"{args[0]}: timed out after {timeout:.0f}s") from exc
    if proc.returncode != 0:
        raise BuildError(f"{' '.join(args[:3])}: exit {proc.returncode}: {_tail(proc.stderr)}")
    return proc.stdout.decode(errors="replace")


def _tail(stderr: bytes) -> str:
    lines = [ln.strip() for ln in stderr.decode(errors="replace").splitlines() if ln.strip()]
    # apt prints an unrelated sandbox warning when downloading as root; skip it.
    lines = [ln for ln in lines if "unsandboxed" not in ln]
    return lines[-1] if lines else "(no error output)"
