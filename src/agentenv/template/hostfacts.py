"""Answers to slow host queries (apt-cache, dpkg-query, `cc --version`), kept on disk until
the files they read change.

Every server start resolves the cache keys of its guest artifacts (kernel, initramfs, tools,
RAM shim) from these answers. `apt-cache` alone costs ~0.5 s of CPU a call, so a start spent
over a second of CPU and wall time in child processes before it served; a test run starts
~150 servers. The answer is reused only while the stamps (mtime, size, inode) of what the
query reads are unchanged, so an `apt-get update`, an install or a new compiler is seen.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from agentenv.config_env import default_cache

FACTS_FILE = "host-facts.json"
# What dpkg-query reads.
DPKG_STATE: tuple[Path, ...] = (Path("/var/lib/dpkg/status"),)
# What apt-cache reads: the package lists, its binary caches, the sources and pins, dpkg's view.
APT_STATE: tuple[Path, ...] = (
    *DPKG_STATE,
    Path("/var/lib/apt/lists"),
    Path("/var/cache/apt/pkgcache.bin"),
    Path("/etc/apt"),
    Path("/etc/apt/sources.list.d"),
    Path("/etc/apt/preferences.d"),
)


def stamp(paths: Sequence[Path]) -> list[list[Any]]:
    """What identifies the current content of `paths` (a directory's mtime changes when an
    entry is added, removed or replaced by rename, as apt and dpkg write)."""
    out: list[list[Any]] = []
    for path in paths:
        try:
            st = path.stat()
        except OSError:
            out.append([str(path), None])
            continue
        out.append([str(path), st.st_mtime_ns, st.st_size, st.st_ino])
    return out


def remembered(key: Sequence[str], depends_on: Sequence[Path], compute: Callable[[], str]) -> str:
    """`compute()`'s answer for `key`, reused while `depends_on` is unchanged.

    The stamp is taken after computing: apt-cache may rewrite its own binary cache while it
    answers, and the answer belongs to the state it left."""
    name = "\0".join(key)
    path = default_cache() / FACTS_FILE
    hit = _load(path).get(name)
    if isinstance(hit, dict) and hit.get("stamp") == stamp(depends_on):
        out = hit.get("out")
        if isinstance(out, str):
            return out
    answer = compute()
    facts = _load(path)  # again: another process may have added its own answers meanwhile
    facts[name] = {"stamp": stamp(depends_on), "out": answer}
    _store(path, facts)
    return answer


def tool_version(tool: str) -> str | None:
    """The first line of `tool --version`, reused while the binary it resolves to is unchanged;
    None when the tool is not installed."""
    found = shutil.which(tool)
    if found is None:
        return None
    binary = Path(os.path.realpath(found))

    def query() -> str:
        try:
            out = subprocess.run([found, "--version"], capture_output=True, text=True, check=False)
        except OSError:
            return ""
        return out.stdout.splitlines()[0] if out.returncode == 0 and out.stdout else ""

    return remembered([tool, "--version"], (binary,), query)


def _load(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _store(path: Path, facts: dict[str, Any]) -> None:
    # A write that fails (read-only or full cache) only costs the next start the query again.
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".host-facts-")
    except OSError:
        return
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(facts, f)
        os.replace(tmp, path)
    except OSError:
        Path(tmp).unlink(missing_ok=True)
