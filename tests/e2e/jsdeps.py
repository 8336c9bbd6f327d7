"""The E2B JS SDK for the e2e suite: `npm ci` of tests/e2e/js into the build cache.

The install lives in ``<cache>/npm-e2e-js-<hash>/`` (``AGENTENV_CACHE``, default
``~/.cache/agentenv``), the hash taken over package.json and package-lock.json, so a changed
pin is a new directory and an unchanged one is reused. It is built in a ``.tmp-*`` sibling and
renamed into place, so a directory with the final name is always complete; an empty cache is
rebuilt from the lockfile alone. Node and npm come from Debian packages (`aenv setup
--with-test-tools`, which scripts/bootstrap runs for the dev extras).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

JS_DIR = Path(__file__).parent / "js"
INPUTS = ("package.json", "package-lock.json")
NPM_TIMEOUT_S = 600


def cache_root() -> Path:
    return Path(os.environ.get("AGENTENV_CACHE", Path.home() / ".cache" / "agentenv"))


def inputs_key() -> str:
    digest = hashlib.sha256()
    for name in INPUTS:
        digest.update(name.encode() + b"\0" + (JS_DIR / name).read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def node_version() -> tuple[int, int, int]:
    node = shutil.which("node")
    if node is None:
        raise RuntimeError("node is not installed (aenv setup --with-test-tools installs it)")
    out = subprocess.run([node, "--version"], capture_output=True, text=True, timeout=30).stdout
    m = re.match(r"v(\d+)\.(\d+)\.(\d+)", out.strip())
    if m is None:
        raise RuntimeError(f"unreadable node --version: {out!r}")
    return int(m[1]), int(m[2]), int(m[3])


def sdk_node_range() -> str:
    """The Node versions the pinned e2b package declares (its `engines`, from the lockfile)."""
    lock = json.loads((JS_DIR / "package-lock.json").read_text())
    return str(lock["packages"]["node_modules/e2b"].get("engines", {}).get("node", ""))


def node_satisfies(version: tuple[int, int, int], spec: str) -> bool:
    """Whether `version` is in an npm range made of `>=a.b.c <d` clauses joined by `||`."""
    for clause in spec.split("||"):
        ok = True
        for op, ver in re.findall(r"(>=|<=|>|<|=)?\s*(\d+(?:\.\d+){0,2})", clause):
            bound = tuple(int(x) for x in ver.split("."))
            bound = bound + (0,) * (3 - len(bound))
            ok = ok and {
                ">=": version >= bound,
                ">": version > bound,
                "<=": version <= bound,
                "<": version < bound,
            }.get(op, version == bound)
        if ok:
            return True
    return not spec.strip()


def ensure_js_sdk() -> Path:
    """The cached ``node_modules`` holding the pinned e2b package (installed when missing)."""
    version, spec = node_version(), sdk_node_range()
    if not node_satisfies(version, spec):
        have = ".".join(map(str, version))
        raise RuntimeError(f"node {have} is outside the e2b package's engines range {spec!r}")
    root = cache_root()
    final = root / f"npm-e2e-js-{inputs_key()}"
    if (final / "node_modules" / "e2b" / "package.json").exists():
        return final / "node_modules"
    npm = shutil.which("npm")
    if npm is None:
        raise RuntimeError("npm is not installed (aenv setup --with-test-tools installs it)")
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-npm-e2e-js-", dir=root))
    try:
        for name in INPUTS:
            shutil.copy2(JS_DIR / name, tmp / name)
        # `npm ci` installs exactly the lockfile; no install scripts run (none are needed).
        subprocess.run(
            [npm, "ci", "--ignore-scripts", "--no-audit", "--no-fund", "--loglevel=error"],
            cwd=tmp,
            check=True,
            timeout=NPM_TIMEOUT_S,
            env={**os.environ, "npm_config_update_notifier": "false"},
        )
        (tmp / "inputs.json").write_text(
            json.dumps({"inputs": list(INPUTS), "key": inputs_key(), "node": version}) + "\n"
        )
        try:
            tmp.rename(final)
        except OSError:
            # Another run finished first: its directory is just as complete.
            if not (final / "node_modules" / "e2b").exists():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final / "node_modules"
