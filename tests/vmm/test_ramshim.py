"""The RAM preload library on its own: which fallocate calls it swallows, refuses or passes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from agentenv.config import Settings
from agentenv.vmm.ramshim import ENV_VAR, ensure_ram_shim, find_ram_shim

PROBE = r"""
import ctypes, fcntl, json, os, sys
libc = ctypes.CDLL(None, use_errno=True)
out = {"preload_left": "LD_PRELOAD" in os.environ}
for name, path, mode in json.loads(sys.argv[1]):
    fd = os.open(path, os.O_RDWR)
    ret = libc.fallocate64(fd, mode, ctypes.c_long(0), ctypes.c_long(4096))
    out[name] = [ret, ctypes.get_errno() if ret else 0]
    out[name + "_rdwr"] = os.O_ACCMODE & fcntl.fcntl(fd, fcntl.F_GETFL) == os.O_RDWR
    os.close(fd)
    # What a fortified `open` with non-constant flags calls (QEMU's RAM file open).
    open2 = libc.__open64_2
    open2.argtypes = [ctypes.c_char_p, ctypes.c_int]
    fd = open2(path.encode(), os.O_RDWR)
    out[name + "_open2_rdwr"] = os.O_ACCMODE & fcntl.fcntl(fd, fcntl.F_GETFL) == os.O_RDWR
    os.close(fd)
print(json.dumps(out))
"""
PUNCH = 0x02 | 0x01  # FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE


def test_punching_the_snapshot_is_a_no_op_everything_else_passes(
    settings: Settings, tmp_path: Path
) -> None:
    shim = ensure_ram_shim(settings.cache)
    assert find_ram_shim(settings.cache) == shim
    snapshot, other = tmp_path / "snapshot", tmp_path / "other"
    for f in (snapshot, other):
        f.write_bytes(b"\xab" * 8192)
    calls = [
        ("punch_snapshot", str(snapshot), PUNCH),
        ("allocate_snapshot", str(snapshot), 0),
        ("punch_other", str(other), PUNCH),
    ]
    env = {**os.environ, "LD_PRELOAD": str(shim), ENV_VAR: str(snapshot)}
    res = subprocess.run(
        [sys.executable, "-c", PROBE, json.dumps(calls)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    out = json.loads(res.stdout)
    assert out["punch_snapshot"] == [0, 0]
    assert out["allocate_snapshot"][0] == -1 and out["allocate_snapshot"][1] == 1  # EPERM
    assert out["punch_other"] == [0, 0]
    # The snapshot is opened read-only whatever QEMU asks for; other files as asked.
    assert out["punch_snapshot_rdwr"] is False
    assert out["punch_other_rdwr"] is True
    assert out["punch_snapshot_open2_rdwr"] is False
    assert out["punch_other_open2_rdwr"] is True
    assert out["preload_left"] is False, "children of QEMU must not inherit the library"
    assert snapshot.read_bytes() == b"\xab" * 8192
    assert other.read_bytes()[:4096] == b"\0" * 4096
    assert other.read_bytes()[4096:] == b"\xab" * 4096


def test_without_the_library_the_punch_reaches_the_file(tmp_path: Path) -> None:
    # The control: the same call without the preload does zero the file, so the test above
    # is measuring the library and not a filesystem that ignores hole punching.
    f = tmp_path / "f"
    f.write_bytes(b"\xab" * 8192)
    res = subprocess.run(
        [sys.executable, "-c", PROBE, json.dumps([("punch", str(f), PUNCH)])],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    assert json.loads(res.stdout)["punch"] == [0, 0]
    assert f.read_bytes()[:4096] == b"\0" * 4096


def test_a_missing_compiler_is_a_clear_error(
    settings: Settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    from agentenv.template.errors import BuildError

    with pytest.raises(BuildError, match="C compiler"):
        ensure_ram_shim(tmp_path / "cache")
