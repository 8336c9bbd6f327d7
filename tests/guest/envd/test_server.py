"""envd's server loop (`guest/envd/server.py`): an idle envd wakes about once a second, its
Date header stays fresh, and SIGTERM ends it without waiting for a tick."""

from __future__ import annotations

import email.utils
import signal
import time
from pathlib import Path

import httpx

from .conftest import start_envd


def _wakeups(pid: int) -> int:
    """Voluntary context switches of every thread: each is a sleep the thread woke from."""
    total = 0
    for status in Path(f"/proc/{pid}/task").glob("*/status"):
        for line in status.read_text().splitlines():
            if line.startswith("voluntary_ctxt_switches:"):
                total += int(line.split()[1])
    return total


def test_an_idle_envd_wakes_once_a_second_and_stops_at_once(tmp_path: Path) -> None:
    envd = start_envd(tmp_path)
    try:
        resp = httpx.get(envd.url + "/health", timeout=10)
        sent = email.utils.parsedate_to_datetime(resp.headers["date"]).timestamp()
        assert abs(sent - time.time()) < 3, resp.headers["date"]
        time.sleep(0.5)
        before, t0 = _wakeups(envd.pid), time.monotonic()
        time.sleep(2)
        woke = (_wakeups(envd.pid) - before) / (time.monotonic() - t0)
        # With uvicorn's own loop: 10.0/s.
        assert woke < 3, f"{woke:.1f} wakeups/s"
        t0 = time.monotonic()
        envd.proc.send_signal(signal.SIGTERM)
        # uvicorn re-raises the signal it handled once it has shut down.
        assert envd.proc.wait(10) in (0, -signal.SIGTERM)
        assert time.monotonic() - t0 < 5
    finally:
        envd.stop()
