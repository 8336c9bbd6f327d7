"""Two servers on one host (own data dirs, own ports) do not serialize each other's sandbox
work: while one starts (filling a large slot pool, building its template snapshot, filling
its warm pool), the other's creates and deletes keep their usual latency.

Slot indexes are claimed host-wide (`network.slot._claim_netns`), so both servers use the
default address plan without colliding; only the brief host network lock is shared.
"""

from __future__ import annotations

import statistics
import threading
import time

import httpx
import pytest

from agentenv.api.devserver import ServerProcess
from agentenv.template.datadir import prepare_home

from .conftest import REQUEST_TIMEOUT_S, stop_and_check

pytestmark = pytest.mark.vm

# The starting server's slot pool: every slot is built under the host network lock.
STARTING_SLOT_POOL = 24


def cycle(api: httpx.Client) -> tuple[float, float]:
    """Create and delete one sandbox; (create seconds, delete seconds)."""
    started = time.monotonic()
    resp = api.post("/v2/sandboxes", json={"templateID": "base", "timeout": 120})
    assert resp.status_code == 201, resp.text
    created = time.monotonic()
    gone = api.delete(f"/sandboxes/{resp.json()['sandboxID']}")
    assert gone.status_code == 204, gone.text
    return created - started, time.monotonic() - created


def test_a_starting_server_does_not_hold_up_another_servers_deletes(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    # Both with the product's warm pool (the suite's default is none), and the starting one
    # from nothing: it builds its own template snapshot, as a new server on a host does.
    warm = {"AGENTENV_WARM_LOW": "1", "AGENTENV_WARM_HIGH": "2"}
    busy = ServerProcess(
        prepare_home(tmp_path_factory.mktemp("busy")), ready_timeout_s=180, env=warm
    )
    starting = ServerProcess(
        prepare_home(tmp_path_factory.mktemp("starting"), seeded=False),
        ready_timeout_s=300,
        env={
            **warm,
            "AGENTENV_SLOT_POOL_LOW": str(STARTING_SLOT_POOL // 2),
            "AGENTENV_SLOT_POOL_HIGH": str(STARTING_SLOT_POOL),
        },
    )
    busy.start()
    try:
        with httpx.Client(
            base_url=busy.url, headers={"X-API-Key": busy.api_key}, timeout=REQUEST_TIMEOUT_S
        ) as api:
            cycle(api)  # builds this data dir's template snapshot; warms the pool's shape
            alone = [cycle(api) for _ in range(3)]

            other: dict[str, float] = {}
            failure: list[BaseException] = []

            def start_other() -> None:
                try:
                    t0 = time.monotonic()
                    starting.start()
                    other["ready_s"] = time.monotonic() - t0
                    with httpx.Client(
                        base_url=starting.url,
                        headers={"X-API-Key": starting.api_key},
                        timeout=REQUEST_TIMEOUT_S,
                    ) as api2:
                        # Its first create builds its template snapshot; the next one
                        # makes its warm pool fill behind it.
                        other["first_create_s"], _ = cycle(api2)
                        cycle(api2)
                    other["busy_s"] = time.monotonic() - t0
                except BaseException as exc:
                    failure.append(exc)

            worker = threading.Thread(target=start_other)
            worker.start()
            during: list[tuple[float, float]] = []
            deadline = time.monotonic() + 600
            while worker.is_alive() and time.monotonic() < deadline and len(during) < 60:
                during.append(cycle(api))
            worker.join(timeout=max(0.0, deadline - time.monotonic()) + 60)
            assert not worker.is_alive(), "the starting server never finished"
            assert not failure, failure
    finally:
        try:
            stop_and_check(starting)
        finally:
            stop_and_check(busy)

    def fmt(xs: list[float]) -> str:
        return f"median {statistics.median(xs):.2f} s, max {max(xs):.2f} s (n={len(xs)})"

    alone_del = [d for _, d in alone]
    during_del = [d for _, d in during]
    print(
        f"\nstarting server: ready in {other['ready_s']:.1f} s "
        f"({STARTING_SLOT_POOL} slots), first create {other['first_create_s']:.1f} s, "
        f"busy {other['busy_s']:.1f} s"
        f"\nbusy server DELETE alone:  {fmt(alone_del)}"
        f"\nbusy server DELETE during: {fmt(during_del)}"
        f"\nbusy server create alone:  {fmt([c for c, _ in alone])}"
        f"\nbusy server create during: {fmt([c for c, _ in during])}"
    )
    assert during, "no delete ran while the other server was starting"
    # Loose for a 2-core TCG host where the other server's guest boot takes CPU: a delete
    # may get slower, but not by anything like the other server's busy time.
    assert max(during_del) < max(15.0, 5 * max(alone_del)), fmt(during_del)
    assert max(during_del) < other["busy_s"] / 2, (max(during_del), other["busy_s"])
