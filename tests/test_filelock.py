"""`agentenv.filelock`: one holder across processes, threads and coroutines; waiting happens
in asyncio (never in the default executor), and a deadline ends it with a clear error."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from agentenv import filelock
from agentenv.filelock import LockTimeout, file_lock

HOLD = """
import fcntl, sys, time
fh = open(sys.argv[1], "a+")
fcntl.flock(fh, fcntl.LOCK_EX)
print("held", flush=True)
time.sleep(float(sys.argv[2]))
"""


def _holder(path: Path, seconds: float) -> subprocess.Popen[str]:
    """Another process holding the lock for `seconds` (returns once it holds it)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(path), str(seconds)], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


async def test_waits_for_another_process(tmp_path: Path) -> None:
    path = tmp_path / "x.lock"
    proc = _holder(path, 0.5)
    try:
        t0 = time.monotonic()
        async with file_lock(path, name="the test lock", timeout_s=30):
            waited = time.monotonic() - t0
        assert 0.3 < waited < 10
    finally:
        proc.kill()
        proc.wait()


async def test_deadline_names_lock_waiter_and_holder(tmp_path: Path) -> None:
    path = tmp_path / "build.lock"
    proc = _holder(path, 60)
    try:
        t0 = time.monotonic()
        with pytest.raises(LockTimeout) as info:
            async with file_lock(
                path,
                name="the template build lock of base.1c.512m",
                timeout_s=0.3,
                waiter="a create of 'base'",
            ):
                raise AssertionError("acquired a held lock")
        assert time.monotonic() - t0 < 5
        msg = str(info.value)
        assert msg.startswith("a create of 'base': waited 0s for the template build lock of")
        assert "base.1c.512m" in msg and str(path) in msg
        assert f"held by pid {proc.pid}" in msg
        assert isinstance(info.value, TimeoutError) and info.value.path == path
    finally:
        proc.kill()
        proc.wait()
    # Nothing of the failed attempt stays behind: the lock is free for the next one.
    async with file_lock(path, name="the test lock", timeout_s=5):
        pass


def test_threads_with_their_own_loops_exclude_each_other(tmp_path: Path) -> None:
    path = tmp_path / "t.lock"
    inside = 0
    most = 0
    guard = threading.Lock()

    async def worker() -> None:
        nonlocal inside, most
        for _ in range(5):
            async with file_lock(path, name="the test lock", timeout_s=30):
                with guard:
                    inside += 1
                    most = max(most, inside)
                await asyncio.sleep(0.01)
                with guard:
                    inside -= 1

    threads = [threading.Thread(target=asyncio.run, args=(worker(),)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)
    assert most == 1


async def test_many_coroutines_do_not_exhaust_the_executor(tmp_path: Path) -> None:
    """50 waiters and a two-thread default executor: the holder's own `to_thread` work still
    runs (a blocking flock in `to_thread` per waiter deadlocked here)."""
    loop = asyncio.get_running_loop()
    pool = ThreadPoolExecutor(max_workers=2)
    loop.set_default_executor(pool)
    path = tmp_path / "many.lock"
    order: list[int] = []
    inside = 0

    async def one(i: int) -> None:
        nonlocal inside
        async with file_lock(path, name="the test lock", timeout_s=60):
            inside += 1
            assert inside == 1
            await asyncio.to_thread(time.sleep, 0.002)
            await asyncio.to_thread(path.stat)
            order.append(i)
            inside -= 1

    async with asyncio.timeout(60):
        await asyncio.gather(*(one(i) for i in range(50)))
    # Coroutines of one process queue in asyncio, in arrival order.
    assert order == list(range(50))


async def test_timeout_while_queued_in_process(tmp_path: Path) -> None:
    path = tmp_path / "q.lock"
    held = asyncio.Event()
    release = asyncio.Event()

    async def holder() -> None:
        async with file_lock(path, name="the test lock", timeout_s=5):
            held.set()
            await release.wait()

    task = asyncio.create_task(holder())
    await held.wait()
    with pytest.raises(LockTimeout, match="held by another task of this process"):
        async with file_lock(path, name="the test lock", timeout_s=0.1, waiter="second"):
            pass
    release.set()
    await task
    async with file_lock(path, name="the test lock", timeout_s=1):
        pass


async def test_cancelled_waiter_leaves_nothing_held(tmp_path: Path) -> None:
    path = tmp_path / "c.lock"
    proc = _holder(path, 0.3)
    try:
        waiter = asyncio.create_task(_hold_briefly(path))
        await asyncio.sleep(0.05)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
    finally:
        proc.wait()
    async with file_lock(path, name="the test lock", timeout_s=5):
        pass
    assert not filelock._local_lock(path).locked()


async def _hold_briefly(path: Path) -> None:
    async with file_lock(path, name="the test lock", timeout_s=30):
        await asyncio.sleep(0)


async def test_template_snapshot_fast_path_takes_no_lock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A current template snapshot is returned without the build lock (and so without
    waiting for someone else's build of it)."""
    from dataclasses import replace

    from agentenv.config import Settings
    from agentenv.snapshot import templates

    current = object()

    class Snap:
        build_key = "k"

    class Repo:
        def get(self, alias: str) -> Any:
            assert alias == "base.1c.512m"
            return Snap()

    class Catalog:
        def __init__(self, _: Any) -> None:
            pass

        def get(self, name: str) -> Any:
            return type("Tpl", (), {"layers": ["l"], "build_key": "t"})()

    def no_lock(*_: Any, **__: Any) -> Any:
        raise AssertionError("took the build lock for a current snapshot")

    monkeypatch.setattr(templates, "repository", lambda _: Repo())
    monkeypatch.setattr(templates, "TemplateCatalog", Catalog)
    monkeypatch.setattr(templates, "build_key", lambda *_: "k")
    monkeypatch.setattr(templates, "file_lock", no_lock)
    settings = replace(Settings.from_env(), home=tmp_path)
    snap = await templates.ensure_template_snapshot(settings, "base", 512, 1, current)  # type: ignore[arg-type]
    assert isinstance(snap, Snap)
