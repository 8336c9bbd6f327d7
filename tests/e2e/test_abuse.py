"""Contained guests: one sandbox abusing its VM (fork bomb, full disk, memory beyond its RAM,
stdout floods read and unread, thousands of sockets, every vCPU busy) leaves its neighbour
usable, the server healthy, the host above its free memory and disk floors, and is still
killed cleanly. Plus the disk throttle: a guest's direct writes run at the configured rate.

The driver is bench/abuse.py (full scale: 1 GB of stdout, 10,000 sockets, a disk filled to
the end); here the same scenarios at a reduced scale, on one data dir, about 2 minutes on 2
cores under TCG.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from api.conftest import stop_and_check, use_sdk_env
from e2b import Sandbox

from agentenv.api.devserver import ServerProcess
from agentenv.config import Settings
from agentenv.template.datadir import prepare_home

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import abuse

pytestmark = pytest.mark.vm

SCALE = abuse.SUITE
# The neighbour's exec latency under abuse against its idle p99. On this 2-core TCG host the
# abusive guest's QEMU uses at most one core (cpu quota = its one vCPU) while the
# neighbour's QEMU, the server and this test share the other; measured: idle p50 ~105 ms,
# p99 ~240 ms, and under abuse p99/idle 0.99x to 1.34x (stdout_streamed the highest: the
# server relays 13 MB/s; with one more busy process on the host, 2.0x to 2.1x). The bound
# on the p95 is 3x the idle p99, or the idle p99 plus a second (the larger here): loose
# enough for a shared, noisy host, and still failing on a starved neighbour (envd not
# answering for a second, or an exec stuck behind the abuser). The p95, not the p99: a
# scenario takes 30-80 execs, so the p99 is the slowest single one, and CI (two workers
# of VM tests on two cores) saw one exec of 62 take 2.5 s while the rest stayed within
# the bound. One exec stuck for longer than STUCK_S past the idle p99 still fails.
RATIO_BOUND = 3.0
ABSOLUTE_SLACK_S = 1.0
STUCK_S = 5.0
# What a busy abuser's QEMU gets of a core at the least, against ~0.05 for an idle guest.
ABUSER_BUSY_CORES = 0.2
# A kill of a wrecked guest is still a SIGKILL of its QEMU plus cleanup.
KILL_BOUND_S = 30.0
# The server buffers nothing per byte of a guest's output it forwards (unread or not).
RSS_GROWTH_MB = 50
# Throttle check: direct writes of 20 MiB at 5 MiB/s take ~4 s (the bucket lets a burst of
# a tenth of a second's worth through first).
THROTTLE_MB_S = 5
THROTTLE_WRITE_MB = 20


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return prepare_home(tmp_path_factory.mktemp("abuse-home"))


def _limits(home: Path, rid: str) -> dict[str, Any] | None:
    rec = abuse.vm_record(home, rid)
    assert rec is not None, f"no VM record for {rid}"
    limits: dict[str, Any] | None = rec.spec.get("disk_limits")
    return limits


def _direct_write_rate(sbx: Sandbox) -> float:
    """MiB/s of `dd oflag=direct` in the guest (past its page cache, onto the disk)."""
    out = sbx.commands.run(
        "s=$(date +%s.%N); "
        f"dd if=/dev/zero of=/home/user/t bs=1M count={THROTTLE_WRITE_MB} oflag=direct "
        "2>/dev/null; e=$(date +%s.%N); rm -f /home/user/t; echo $s $e",
        timeout=120,
    )
    start, end = map(float, out.stdout.split())
    return THROTTLE_WRITE_MB / (end - start)


def test_disk_throttle_holds_a_guest_to_its_rate(home: Path) -> None:
    # First in the module: its own server on the module's data dir (which builds the
    # template snapshot), stopped before the abuse server starts on the same data dir.
    srv = ServerProcess(
        home,
        domain="sbx.test",
        ready_timeout_s=180,
        env={
            "AGENTENV_DISK_BPS_MB": str(THROTTLE_MB_S),
            "AGENTENV_DISK_IOPS": "0",
            "AGENTENV_WARM_LOW": "0",
            "AGENTENV_WARM_HIGH": "0",
        },
    ).start()
    restore = use_sdk_env(srv)
    try:
        sbx = Sandbox.create(timeout=600)
        rid = abuse.runtime_id(sbx)
        assert _limits(home, rid) == {"bytes_per_s": THROTTLE_MB_S * 2**20, "iops": 0}
        rate = _direct_write_rate(sbx)
        print(f"direct writes at a {THROTTLE_MB_S} MiB/s limit: {rate:.2f} MiB/s")
        assert 0.5 * THROTTLE_MB_S <= rate <= 1.5 * THROTTLE_MB_S
        sbx.kill()
    finally:
        restore()
        stop_and_check(srv)


@pytest.fixture(scope="module")
def server(home: Path) -> Iterator[ServerProcess]:
    srv = ServerProcess(home, domain="sbx.test", ready_timeout_s=180).start()
    restore = use_sdk_env(srv)
    try:
        yield srv
    finally:
        restore()
        stop_and_check(srv)


@pytest.fixture(scope="module")
def neighbour(server: ServerProcess) -> Iterator[Sandbox]:
    sbx = Sandbox.create(timeout=1800)
    try:
        yield sbx
    finally:
        sbx.kill()


@pytest.fixture(scope="module")
def idle(neighbour: Sandbox) -> abuse.Latency:
    abuse.exec_loop(neighbour, count=5)
    lat = abuse.exec_loop(neighbour, count=SCALE.idle_execs)
    assert not lat.errors, lat.errors
    print(f"idle neighbour: p50 {lat.p50 * 1000:.0f} ms, p99 {lat.p99 * 1000:.0f} ms")
    return lat


def test_sandboxes_get_the_default_disk_limits(server: ServerProcess, neighbour: Sandbox) -> None:
    settings = Settings.from_env()
    want = {"bytes_per_s": settings.disk_bps_mb * 2**20, "iops": settings.disk_iops}
    assert _limits(server.home, abuse.runtime_id(neighbour)) == want
    # The same direct writes under the default limit: far faster than the throttle test's
    # rate, so that test measures the limit and not this host's disk or emulation.
    rate = _direct_write_rate(neighbour)
    print(f"direct writes at the default limit: {rate:.1f} MiB/s")
    assert rate > 2 * THROTTLE_MB_S


@pytest.mark.parametrize("name", list(abuse.SCENARIOS))
def test_abusive_neighbour_is_contained(
    name: str, server: ServerProcess, neighbour: Sandbox, idle: abuse.Latency
) -> None:
    result = abuse.run_scenario(name, server, neighbour, idle, SCALE)
    print(result.line())
    print(json.dumps({"scenario": name, "ratio": round(result.ratio, 2)}))
    settings = Settings.from_env()
    assert not result.exec_errors, result.exec_errors
    assert result.execs >= 3, result
    bound = max(RATIO_BOUND * idle.p99, idle.p99 + ABSOLUTE_SLACK_S)
    assert result.p95_s <= bound, f"neighbour p95 {result.p95_s:.2f}s > {bound:.2f}s"
    stuck = idle.p99 + STUCK_S
    assert result.max_s <= stuck, f"a neighbour exec took {result.max_s:.2f}s > {stuck:.2f}s"
    assert result.health_checks > 0 and not result.health_bad, result.health_bad
    assert result.min_mem_available_mb >= settings.min_free_memory_mb
    assert result.min_free_disk_mb >= settings.min_free_disk_mb
    assert result.server_rss_growth_mb <= RSS_GROWTH_MB
    assert result.kill_s <= KILL_BOUND_S
    assert not result.leftovers, result.leftovers
    assert not result.detail.get("stream_open_after_kill"), result.detail
    # The abuse happened (a scenario whose command did nothing would pass everything above).
    detail = result.detail
    window = result.measured_s + abuse.RAMP_S
    if name in ("fork_bomb", "cpu_busy"):
        # Its QEMU was busy: an idle guest's QEMU under TCG uses ~0.05 of a core, a busy one
        # up to its quota (one core: cpu.max = vCPUs) or what the host's other load leaves
        # it (with two workers on two cores 0.35 of a core was seen; the suite now runs
        # three, and the bound, 0.2, is four times an idle guest's share).
        assert detail["abuser_cpu_s"] >= ABUSER_BUSY_CORES * result.measured_s, detail
    if name == "memory_hog":
        assert detail["abuser_max_rss_mb"] >= 0.75 * settings.default_memory_mb, detail
    if name == "disk_fill":
        # It wrote, and the host disk saw no more than the throttle lets through. What it
        # writes in the window is what its emulated CPU gets to: 90 MB was seen with three
        # test workers on two cores, against the throttle's 100 MB/s.
        assert detail["upper_growth_mb"] >= 32, detail
        assert detail["upper_growth_mb"] <= 1.2 * settings.disk_bps_mb * window, detail
    if name in ("stdout_streamed", "sockets"):
        # Commands meant to work (the others may well fail in a guest they wreck).
        assert result.abuse_error is None, result.abuse_error
    if name == "stdout_streamed":
        # Reduced scale: the whole flood reached the client.
        assert result.detail.get("bytes") == SCALE.stdout_bytes, result.detail
    if name == "sockets":
        assert result.detail.get("opened") == f"open {SCALE.sockets}", result.detail
    # The neighbour still answers normally once the abuser is gone.
    after = abuse.exec_loop(neighbour, count=5)
    assert not after.errors and after.p50 <= bound


def test_neighbour_still_fine_after_all(neighbour: Sandbox, idle: abuse.Latency) -> None:
    start = time.monotonic()
    after = abuse.exec_loop(neighbour, count=SCALE.idle_execs)
    assert not after.errors
    print(f"idle again: p50 {after.p50 * 1000:.0f} ms ({time.monotonic() - start:.1f}s)")
    assert after.p50 <= max(RATIO_BOUND * idle.p50, idle.p50 + ABSOLUTE_SLACK_S)
