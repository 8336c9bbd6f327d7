"""envd's server loop (`guest/quiet_server.py`): an idle envd wakes about once a second, its
Date header stays fresh, and SIGTERM ends it without waiting for a tick."""

from __future__ import annotations

import email.utils
import signal
import time
from pathlib import Path

import httpx

from ..wakeups import wakeups_per_s
from .conftest import start_envd


def test_an_idle_envd_wakes_once_a_second_and_stops_at_once(tmp_path: Path) -> None:
    envd = start_envd(tmp_path)
    try:
        resp = httpx.get(envd.url + "/health", timeout=10)
        sent = email.utils.parsedate_to_datetime(resp.headers["date"]).timestamp()
        assert abs(sent - time.time()) < 3, resp.headers["date"]
        time.sleep(0.5)
        woke = wakeups_per_s(envd.pid)
        # With uvicorn's own loop: 10.0/s.
        assert woke < 3, f"{woke:.1f} wakeups/s"
        t0 = time.monotonic()
        envd.proc.send_signal(signal.SIGTERM)
        # uvicorn re-raises the signal it handled once it has shut down.
        assert envd.proc.wait(10) in (0, -signal.SIGTERM)
        assert time.monotonic() - t0 < 5
    finally:
        envd.stop()
