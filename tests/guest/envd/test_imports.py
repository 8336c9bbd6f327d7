"""envd runs in the guest from a tools layer holding only the stdlib, `agentenv.guest`,
`agentenv.ports` (`ENVD_PORT`) and requirements.txt; anything else
it imports would be missing there."""

from __future__ import annotations

import importlib.metadata
import re
import subprocess
import sys
from pathlib import Path

import agentenv.guest.envd as envd_pkg

REQUIREMENTS = Path(envd_pkg.__file__).with_name("requirements.txt")


def _modules(code: str) -> set[str]:
    out = subprocess.run(
        # A None entry is a failed import remembered (agentenv's for sniffio), not a module.
        [
            sys.executable,
            "-c",
            f"{code}\nimport sys\n"
            "print('\\n'.join(k for k, v in sys.modules.items() if v is not None))",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return set(out.split())


def _normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_envd_imports_only_stdlib_requirements_and_itself() -> None:
    pinned = {
        _normalise(line.split("==")[0])
        for line in REQUIREMENTS.read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    providers = importlib.metadata.packages_distributions()
    baseline = _modules("")  # what the interpreter and site hooks load anyway
    # uvicorn loads its protocol, loop and lifespan modules only in run(); name them here.
    loaded = (
        _modules(
            "import agentenv.guest.envd.__main__, agentenv.guest.envd.app\n"
            "import uvicorn.protocols.http.h11_impl, uvicorn.loops.asyncio, uvicorn.lifespan.on"
        )
        - baseline
    )
    assert {"uvicorn", "h11", "starlette", "connectrpc", "python_multipart"} <= {
        m.split(".")[0] for m in loaded
    }
    foreign = set()
    for module in loaded:
        top = module.split(".")[0]
        if top in sys.stdlib_module_names or top == "agentenv" or top.startswith("__"):
            continue
        dists = {_normalise(d) for d in providers.get(top, [])}
        if not dists & pinned:
            foreign.add(f"{module} (from {sorted(dists) or 'nowhere'})")
    assert not foreign, f"envd imports packages missing from requirements.txt: {sorted(foreign)}"
    own = {m for m in loaded if m.startswith("agentenv.")}
    packed = {"agentenv", "agentenv.guest", "agentenv.ports"}  # in the tools layer too
    outside = {m for m in own if not m.startswith("agentenv.guest.envd") and m not in packed}
    assert not outside, f"envd imports other agentenv packages: {sorted(outside)}"


def test_help_stays_cheap() -> None:
    loaded = _modules(
        "import sys; sys.argv = ['envd', '--help']\nimport agentenv.guest.envd.__main__"
    )
    heavy = {
        m for m in loaded if m.split(".")[0] in {"uvicorn", "starlette", "connectrpc", "protobuf"}
    }
    assert not heavy, f"`--help` should not import the server stack: {sorted(heavy)[:5]}"
