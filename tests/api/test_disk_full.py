"""A full data dir: a small loop-mounted ext4 is the server's whole data dir.

Create, pause and snapshot on a full disk get a JSON 503 or 507 that says what is short;
nothing is half made, the running sandbox runs on with its files, and once space returns
everything works again.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from agentenv.api.devserver import ServerProcess
from agentenv.template.datadir import prepare_home

from .conftest import REQUEST_TIMEOUT_S, stop_and_check

pytestmark = pytest.mark.vm

FS_MB = 1600
# What the filler leaves free: less than a pause's RAM stream, more than a sandbox upper.
LEAVE_MB = 12


def _sh(*args: str) -> str:
    return subprocess.run(args, check=True, capture_output=True, text=True).stdout.strip()


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    image, mnt = tmp_path / "fs.img", tmp_path / "mnt"
    mnt.mkdir()
    with image.open("wb") as f:
        f.truncate(FS_MB * 1024 * 1024)
    _sh("mkfs.ext4", "-q", "-F", str(image))
    _sh("mount", "-o", "loop", str(image), str(mnt))
    try:
        yield mnt
    finally:
        _unmount(mnt)


# A process that exits as the server stops may hold a file on the mount for a moment more
# (a process's files close late in its exit, after its command line is gone).
UNMOUNT_TRIES = 20
UNMOUNT_PAUSE_S = 0.5


def _unmount(mnt: Path) -> None:
    for _ in range(UNMOUNT_TRIES):
        if subprocess.run(("umount", str(mnt)), capture_output=True).returncode == 0:
            return
        time.sleep(UNMOUNT_PAUSE_S)
    raise AssertionError(f"{mnt} stayed busy: {_holders(mnt)}")


def _holders(mnt: Path) -> list[str]:
    """Processes with a file, working directory or root on `mnt`."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            links = [proc / "cwd", proc / "root", *(proc / "fd").iterdir()]
            held = [str(os.readlink(link)) for link in links if link.is_symlink()]
            if any(h.startswith(str(mnt)) for h in held):
                found.append(f"{proc.name} {(proc / 'cmdline').read_bytes()[:80]!r}")
    return found


def _free_mb(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize // (1024 * 1024)


@contextlib.contextmanager
def _filled(mnt: Path) -> Iterator[None]:
    filler = mnt / "filler"
    _sh("fallocate", "-l", f"{max(1, _free_mb(mnt) - LEAVE_MB)}M", str(filler))
    try:
        yield
    finally:
        filler.unlink()


def _error(resp: httpx.Response, statuses: tuple[int, ...]) -> str:
    assert resp.status_code in statuses, resp.text
    body = resp.json()
    assert body["code"] == resp.status_code and body["message"], resp.text
    return str(body["message"])


def _run(api: httpx.Client, srv: ServerProcess, sandbox_id: str, cmd: str) -> str:
    from e2b import Sandbox

    os.environ.update(srv.sdk_env())
    return Sandbox.connect(sandbox_id).commands.run(cmd).stdout


def test_full_data_dir_refuses_cleanly_and_recovers(small_fs: Path) -> None:
    home = prepare_home(small_fs / "home")
    env = {
        "AGENTENV_MIN_FREE_DISK_MB": "64",
        "AGENTENV_WARM_LOW": "0",
        "AGENTENV_WARM_HIGH": "0",
        # The test's own numbers decide what fits, not the host's memory.
        "AGENTENV_IDLE_RECLAIM_S": "0",
    }
    saved = {k: os.environ.get(k) for k in ("E2B_API_URL", "E2B_SANDBOX_URL", "E2B_API_KEY")}
    srv = ServerProcess(home, env=env, ready_timeout_s=240).start()
    try:
        with httpx.Client(
            base_url=srv.url, headers={"X-API-Key": srv.api_key}, timeout=REQUEST_TIMEOUT_S
        ) as api:
            resp = api.post("/v2/sandboxes", json={"templateID": "base", "timeout": 900})
            assert resp.status_code == 201, resp.text
            sid = resp.json()["sandboxID"]
            _run(api, srv, sid, "echo kept > /home/user/k.txt && sync")
            dirs_before = sorted(os.listdir(home / "sandboxes"))
            with _filled(small_fs):
                # Create: refused before anything exists, naming the disk.
                msg = _error(api.post("/v2/sandboxes", json={"templateID": "base"}), (503, 507))
                assert "disk" in msg or "space" in msg, msg
                assert sorted(os.listdir(home / "sandboxes")) == dirs_before
                # Pause: the RAM stream does not fit; the sandbox runs on.
                msg = _error(api.post(f"/sandboxes/{sid}/pause"), (507,))
                assert str(home) in msg, msg
                assert api.get(f"/sandboxes/{sid}").json()["state"] == "running"
                assert not (home / "sandboxes" / dirs_before[0] / "paused.json").exists()
                # Snapshot: the same.
                msg = _error(api.post(f"/sandboxes/{sid}/snapshots", json={}), (507,))
                assert api.get(f"/sandboxes/{sid}").json()["state"] == "running"
                assert _run(api, srv, sid, "cat /home/user/k.txt").strip() == "kept"
            # Space is back: everything works, nothing was corrupted.
            assert api.post(f"/sandboxes/{sid}/pause").status_code == 204
            resp = api.post(f"/sandboxes/{sid}/connect", json={"timeout": 900})
            assert resp.status_code == 201, resp.text
            assert _run(api, srv, sid, "cat /home/user/k.txt").strip() == "kept"
            resp = api.post(f"/sandboxes/{sid}/snapshots", json={"name": "after-full"})
            assert resp.status_code == 201, resp.text
            resp = api.post("/v2/sandboxes", json={"templateID": "after-full"})
            assert resp.status_code == 201, resp.text
            other = resp.json()["sandboxID"]
            assert _run(api, srv, other, "cat /home/user/k.txt").strip() == "kept"
            for s in (sid, other):
                assert api.delete(f"/sandboxes/{s}").status_code == 204
            assert api.delete("/templates/after-full").status_code == 204
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        stop_and_check(srv)
