"""The tools layer's Python runs in an empty root, without the host's /usr."""

from __future__ import annotations

import subprocess
from pathlib import Path

from agentenv.config import Settings
from agentenv.template import tools
from agentenv.template.artifacts import GuestArtifacts


def _tree(settings: Settings, root: Path) -> Path:
    tree = root / ".agentenv"
    tools.populate_tree(tree, tools.ensure_runtime(settings), tools.ensure_pydeps(settings))
    return tree


def test_runtime_runs_in_an_empty_chroot(settings: Settings, tmp_path: Path) -> None:
    tree = _tree(settings, tmp_path)
    # Only the guest package and its ports are packed (and hashed into the layer's key): the
    # host's settings and the code-interpreter server (its own template) are not, so editing
    # them keeps the tools layer and every template snapshot. The imports below prove that
    # nothing else is needed.
    pkg = tree / "python" / "site-packages" / "agentenv"
    assert sorted(p.name for p in pkg.iterdir() if p.name != "__pycache__") == [
        "__init__.py",
        "guest",
        "ports.py",
    ]
    assert not (pkg / "guest" / "interpreter").exists()
    assert (pkg / "guest" / "envd" / "app.py").is_file()
    # Nothing but the tools tree: no /usr, /lib, /bin or libc in the root.
    assert sorted(p.name for p in tmp_path.iterdir()) == [".agentenv"]
    code = (
        "import sys, os, ssl, json, sqlite3, ctypes, asyncio, hashlib, uvicorn, starlette;"
        # envd's whole app: its native extensions (pyqwest links libgcc_s) load too.
        "import agentenv.guest.init, agentenv.guest.envd, agentenv.guest.envd.app;"
        "print(sys.prefix, sys.flags.isolated, 'PYTHONHOME' in os.environ,"
        " all(p.startswith('/.agentenv/') for p in sys.path))"
    )
    out = subprocess.run(
        ["chroot", str(tmp_path), "/.agentenv/bin/python", "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["/.agentenv/python/bin", "1", "False", "True"]


def test_runtime_leaves_nothing_for_children(settings: Settings, tmp_path: Path) -> None:
    """A child of the tools Python inherits no loader or Python variables from it."""
    tree = _tree(settings, tmp_path)
    code = (
        "import subprocess;"
        "print(subprocess.run(['/.agentenv/bin/busybox', 'env'], capture_output=True,"
        " text=True, check=True).stdout)"
    )
    out = subprocess.run(
        ["/usr/sbin/chroot", str(tmp_path), "/.agentenv/bin/python", "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
        env={"HOME": "/"},
    )
    names = [line.split("=", 1)[0] for line in out.stdout.split()]
    assert "HOME" in names
    assert not [n for n in names if n.startswith(("PYTHON", "LD_"))]
    assert (tree / "python" / "lib" / "ld-linux-x86-64.so.2").is_file()


def test_tools_image_is_ext4_with_our_label(guest_artifacts: GuestArtifacts) -> None:
    out = subprocess.run(
        ["dumpe2fs", "-h", str(guest_artifacts.tools_image)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert f"Filesystem volume name:   {tools.TOOLS_LABEL}" in out
    listing = subprocess.run(
        ["debugfs", "-R", "ls -p /", str(guest_artifacts.tools_image)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    for name in ("init", "bin", "python", "mnt", "dev"):
        assert f"/{name}/" in listing
