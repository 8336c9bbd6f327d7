"""The base template: registered once, a cache hit afterwards, with E2B's default user."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

from agentenv.config import Settings
from agentenv.storage.layers import LayerStore
from agentenv.template.catalog import TemplateCatalog
from agentenv.template.rootfs import BASE_NAME, HOLDER, ensure_base


def _debugfs_cat(image: Path, path: str) -> str:
    return subprocess.run(
        ["debugfs", "-R", f"cat {path}", str(image)], capture_output=True, text=True, check=True
    ).stdout


def test_base_is_registered_and_then_a_cache_hit(settings: Settings, tmp_path: Path) -> None:
    template = ensure_base(settings)
    store = LayerStore(settings.layers_dir)
    assert TemplateCatalog(settings).get(BASE_NAME) == template
    assert HOLDER + BASE_NAME in store.holders(template.layers[-1])
    assert template.size_mb >= 1024

    t0 = time.monotonic()
    assert ensure_base(settings) == template
    assert time.monotonic() - t0 < 3

    raw = tmp_path / "base.raw"
    subprocess.run(
        ["qemu-img", "convert", "-O", "raw", str(store.path(template.layers[-1])), str(raw)],
        check=True,
    )
    assert "user:x:1000:1000::/home/user:/bin/bash" in _debugfs_cat(raw, "/etc/passwd")
    assert "NOPASSWD" in _debugfs_cat(raw, "/etc/sudoers.d/user")
    listing = subprocess.run(
        ["debugfs", "-R", "ls -p /", str(raw)], capture_output=True, text=True, check=True
    ).stdout
    assert "/.agentenv/" in listing
    python = subprocess.run(
        ["debugfs", "-R", "stat /usr/bin/python", str(raw)], capture_output=True, text=True
    ).stdout
    assert "python3" in python, python  # python-is-python3: a symlink to python3
    assert _debugfs_cat(raw, "/etc/resolv.conf") == ""  # left to the guest init
