"""Churn without drift: many create → `commands.run` → kill cycles through the official SDK
against a real server process (every 10th with a pause + resume, every 25th with a fork of
2), on a few worker threads. After a warm-up the server's fds, threads, RSS, SQLite size and
on-disk leftovers must stay flat, and nothing may be left once every sandbox is killed.

The driver is bench/churn.py (which runs 1,000 cycles, a pause every 10th, and prints the same
numbers); here AGENTENV_CHURN_CYCLES (default 45) cycles with a pause every 4th and a fork every
15th, under a minute on 2 cores under TCG (it was 100 cycles, ~110 s, then 60). That still
catches what it was written for: after the warm-up (the first 4 cycles), one fd or thread
leaked per create (41), or per pause (10 of its 11 pauses), is past the slack; RSS catches
~1 MB a cycle; 3 forks.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from api.conftest import qemu_processes, stop_and_check

from agentenv.api.devserver import ServerProcess
from agentenv.template.datadir import prepare_home

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import churn

pytestmark = pytest.mark.vm

CYCLES = int(os.environ.get("AGENTENV_CHURN_CYCLES", "45"))
PAUSE_EVERY = 4
FORK_EVERY = 15
WORKERS = 4
# Absolute slack against the warm-up sample. Threads: asyncio runs a watcher thread per
# live child process and the default executor grows on demand; fds: a few sockets.
FD_SLACK = 8
THREAD_SLACK = 4
RSS_GROWTH_MB = 40
# Rows of gone sandboxes (and their log lines) are kept: some bytes per cycle are expected.
SQLITE_BYTES_PER_CYCLE = 8 * 1024
# The WAL is checkpointed at ~4 MB and then reused; past that, a reader holds it open.
WAL_MAX_BYTES = 16 * 1024 * 1024


@pytest.fixture(scope="module")
def churn_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    home = prepare_home(tmp_path_factory.mktemp("churn-home"))
    srv = ServerProcess(home, env=churn.SERVER_ENV, ready_timeout_s=180).start()
    try:
        yield srv
    finally:
        stop_and_check(srv)


def test_churn_without_drift(churn_server: ServerProcess) -> None:
    report = churn.churn(
        churn_server,
        CYCLES,
        WORKERS,
        samples=2,
        progress=print,
        pause_every=PAUSE_EVERY,
        fork_every=FORK_EVERY,
    )
    churn.print_report(report)
    c, b, e = report.counters, report.base, report.end
    assert not c.errors, c.errors[:5]
    assert c.creates == CYCLES
    assert c.pauses == CYCLES // PAUSE_EVERY and c.forks == CYCLES // FORK_EVERY
    assert e.cycles == CYCLES and 0 < b.cycles < CYCLES

    # Flat after the warm-up (every value here was read from /proc or the disk).
    assert e.fds <= b.fds + FD_SLACK, f"open fds {b.fds} -> {e.fds}"
    assert e.threads <= b.threads + THREAD_SLACK, f"threads {b.threads} -> {e.threads}"
    rss_mb = (e.rss_kb - b.rss_kb) / 1024
    assert rss_mb < RSS_GROWTH_MB, f"RSS grew {rss_mb:.1f} MB over {e.cycles - b.cycles} cycles"
    per_cycle = (e.db_used_bytes - b.db_used_bytes) / (e.cycles - b.cycles)
    assert per_cycle < SQLITE_BYTES_PER_CYCLE, f"SQLite grows {per_cycle:.0f} B per cycle"
    assert e.wal_bytes < WAL_MAX_BYTES, f"WAL at {e.wal_bytes} bytes: never checkpointed"
    assert (e.layers, e.snapshots) == (b.layers, b.snapshots), (b, e)
    # Slots: the warm entries' and those the pool keeps for reuse (reset, at most its
    # cap); none left behind.
    assert not e.stray_slots, e.stray_slots
    assert e.pooled_slots <= churn.SLOT_POOL, e
    held = (b.netns - b.pooled_slots, e.netns - e.pooled_slots)
    assert held[0] == held[1], f"slot namespaces held by VMs {held[0]} -> {held[1]}"

    # Nothing left after all kills but the warm pool (full, one QEMU per entry).
    assert e.sandbox_dirs == 0, os.listdir(churn_server.home / "sandboxes")
    assert e.qemus == 0 and not qemu_processes(churn_server.home, converters=True)
    assert e.warm_entries == e.warm_qemus == churn.WARM
    with httpx.Client(
        base_url=churn_server.url, headers={"X-API-Key": churn_server.api_key}, timeout=60
    ) as api:
        running = api.get("/v2/sandboxes", params={"state": "running,paused"})
        running.raise_for_status()
        assert running.json() == []
