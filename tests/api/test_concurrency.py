"""Many creates at once against a real server, and what a node at capacity answers.

- A server with ``AGENTENV_MAX_SANDBOXES=2`` queues a third create until a sandbox ends (a
  burst waits for capacity instead of failing), and past ``AGENTENV_CAPACITY_WAIT_S`` refuses
  it with 503, a ``Retry-After`` header and the usual JSON body, having made nothing for it;
  the official SDK raises `ServiceBusyException` carrying the message. A fork of 2 from a
  snapshot with one place free waits as one start, no child before both fit. The full-scale burst
  (200 creates against a node that holds 16) is `bench/burst.py`.
- 32 concurrent `Sandbox.create` through the SDK (threads) all succeed or get that 503, each
  within a bound; killing them all leaves nothing behind. Creates beyond
  ``AGENTENV_MAX_STARTS`` wait in the node's FIFO start queue; none may deadlock the server
  (8 did, before template builds and the host network lock waited in asyncio).

Both servers share one data dir (one after the other), so the template snapshot is built
once.
"""

from __future__ import annotations

import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from agentenv.api.devserver import ServerProcess
from agentenv.template.datadir import prepare_home

from .conftest import REQUEST_TIMEOUT_S, qemu_processes, stop_and_check

pytestmark = pytest.mark.vm

BURST = 32
# One create may wait for the whole burst ahead of it (two starts at a time on this host).
CREATE_BOUND_S = 240.0


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return prepare_home(tmp_path_factory.mktemp("concurrency-home"))


def _sdk_opts(srv: ServerProcess) -> dict[str, Any]:
    return {
        "api_url": srv.url,
        "sandbox_url": srv.url,
        "api_key": srv.api_key,
        "domain": "sbx.test",
        "request_timeout": REQUEST_TIMEOUT_S,
    }


def _sandbox_dirs(home: Path) -> list[str]:
    root = home / "sandboxes"
    return sorted(p.name for p in root.iterdir()) if root.is_dir() else []


def _wait_for_log(srv: ServerProcess, text: str, count: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while srv.log_path.read_text(errors="replace").count(text) < count:
        assert time.monotonic() < deadline, f"no {count}x {text!r} in the log: {srv.log_tail()}"
        time.sleep(0.05)


def test_a_node_at_capacity_queues_a_create_then_answers_503(home: Path) -> None:
    from e2b import Sandbox
    from e2b.exceptions import ServiceBusyException

    wait_s = 6
    srv = ServerProcess(
        home,
        domain="sbx.test",
        env={
            "AGENTENV_MAX_SANDBOXES": "2",
            "AGENTENV_CAPACITY_WAIT_S": str(wait_s),
            "AGENTENV_WARM_LOW": "0",
            "AGENTENV_WARM_HIGH": "0",
        },
        ready_timeout_s=180,
    ).start()
    try:
        with httpx.Client(
            base_url=srv.url, headers={"X-API-Key": srv.api_key}, timeout=REQUEST_TIMEOUT_S
        ) as api:

            def create() -> httpx.Response:
                return api.post("/v2/sandboxes", json={"templateID": "base", "timeout": 300})

            ids = []
            for _ in range(2):
                resp = create()
                assert resp.status_code == 201, resp.text
                ids.append(resp.json()["sandboxID"])

            # A third create queues (the node logs it) and is made once one sandbox ends.
            with ThreadPoolExecutor(1) as pool:
                queued = pool.submit(create)
                _wait_for_log(srv, "waits for capacity", 1, 30)
                assert not queued.done()
                assert api.delete(f"/sandboxes/{ids.pop()}").status_code == 204
                resp = queued.result(timeout=REQUEST_TIMEOUT_S)
            assert resp.status_code == 201, resp.text
            ids.append(resp.json()["sandboxID"])

            # Nobody ends one now: past the wait, 503 with the numbers and a Retry-After.
            t0 = time.monotonic()
            resp = create()
            waited = time.monotonic() - t0
            assert resp.status_code == 503, resp.text
            assert wait_s - 1 < waited < wait_s + 20, waited
            assert resp.headers["content-type"].startswith("application/json")
            assert int(resp.headers["retry-after"]) > 0
            body = resp.json()
            assert set(body) == {"code", "message"} and body["code"] == 503
            assert "no capacity: 2 of 2 sandboxes in use" in body["message"], body
            assert f"waited {wait_s}s for capacity" in body["message"], body
            # Nothing was made for it: two VMs, two sandbox dirs, two running rows.
            assert len(qemu_processes(home)) == 2
            assert len(_sandbox_dirs(home)) == 2
            listed = api.get("/v2/sandboxes").json()
            assert sorted(s["sandboxID"] for s in listed) == sorted(ids)

            # A create sets its own wait: 0 in the body refuses at once, without queueing.
            queued_before = srv.log_path.read_text(errors="replace").count("waits for capacity")
            resp = api.post(
                "/v2/sandboxes", json={"templateID": "base", "timeout": 300, "capacityWait": 0}
            )
            assert resp.status_code == 503, resp.text
            assert "waited" not in resp.json()["message"], resp.text
            log_now = srv.log_path.read_text(errors="replace")
            assert log_now.count("waits for capacity") == queued_before
            # A wait that is not whole seconds in range, or given twice, is refused by name.
            for headers, body in (
                ({"X-Capacity-Wait": "soon"}, {}),
                ({"X-Capacity-Wait": "601"}, {}),
                ({"X-Capacity-Wait": "1"}, {"capacityWait": 1}),
            ):
                resp = api.post(
                    "/v2/sandboxes",
                    json={"templateID": "base", "timeout": 300, **body},
                    headers=headers,
                )
                assert resp.status_code == 400, resp.text
                assert "X-Capacity-Wait" in resp.json()["message"], resp.text
            # The SDK raises ServiceBusyException with the server's message (retries off:
            # it would otherwise wait Retry-After and try again, three times). It sets its
            # own wait with a header, the one thing an SDK create can add.
            with pytest.raises(ServiceBusyException) as info:
                Sandbox.create(
                    template="base",
                    timeout=300,
                    retries=0,
                    api_headers={"X-Capacity-Wait": "1"},
                    **_sdk_opts(srv),
                )
            assert "503" in str(info.value)
            assert "2 of 2 sandboxes in use" in str(info.value)
            assert "waited 1s for capacity" in str(info.value)
            # Refusals are counted as such, not as failed creates.
            metrics = api.get("/metrics").text
            assert 'agentenv_sandbox_create_refusals_total{status="503"} 3.0' in metrics
            assert "agentenv_sandbox_create_failures_total 0.0" in metrics

            # A fork of 2 from a snapshot with 1 of 2 places free waits as one start (#24):
            # no child starts before both fit (a child each would hold the one place while
            # its sibling waited), then both are made once a sandbox ends.
            assert api.delete(f"/sandboxes/{ids.pop()}").status_code == 204
            resp = api.post(f"/sandboxes/{ids[0]}/snapshots", json={"name": "conc-task"})
            assert resp.status_code == 201, resp.text
            queued_before = srv.log_path.read_text(errors="replace").count("waits for capacity")
            with ThreadPoolExecutor(1) as pool:
                forked = pool.submit(
                    api.post, "/snapshots/conc-task/fork", json={"count": 2, "timeout": 300}
                )
                _wait_for_log(srv, "waits for capacity", queued_before + 1, 30)
                log_now = srv.log_path.read_text(errors="replace")
                assert "2 creates from snapshot '" in log_now
                assert len(qemu_processes(home)) == 1 and not forked.done()
                assert api.delete(f"/sandboxes/{ids.pop()}").status_code == 204
                resp = forked.result(timeout=REQUEST_TIMEOUT_S)
            assert resp.status_code == 201, resp.text
            ids.extend(kid["sandbox"]["sandboxID"] for kid in resp.json())
            assert len(ids) == 2 and len(qemu_processes(home)) == 2
            for sid in ids:
                assert api.delete(f"/sandboxes/{sid}").status_code == 204
            assert api.delete("/templates/conc-task").status_code == 204
    finally:
        stop_and_check(srv)


def test_concurrent_sdk_creates(home: Path) -> None:
    from e2b import Sandbox
    from e2b.exceptions import ServiceBusyException

    srv = ServerProcess(home, domain="sbx.test", ready_timeout_s=180).start()
    opts = _sdk_opts(srv)
    try:
        # The template snapshot first (a cold boot on a fresh data dir), so that the burst
        # measures creates, not one build everybody waits for.
        Sandbox.create(template="base", timeout=120, **opts).kill()

        def create(_: int) -> tuple[float, Any]:
            t0 = time.monotonic()
            try:
                sbx: Any = Sandbox.create(template="base", timeout=600, retries=0, **opts)
            except ServiceBusyException as exc:
                sbx = exc
            return time.monotonic() - t0, sbx

        t0 = time.monotonic()
        with ThreadPoolExecutor(BURST) as pool:
            results = list(pool.map(create, range(BURST)))
        wall = time.monotonic() - t0
        made = [s for _, s in results if not isinstance(s, ServiceBusyException)]
        refused = [s for _, s in results if isinstance(s, ServiceBusyException)]
        times = sorted(d for d, _ in results)
        p50 = statistics.median(times)
        p99 = times[min(len(times) - 1, round(0.99 * (len(times) - 1)))]
        print(
            f"\n{BURST} concurrent creates: {len(made)} made, {len(refused)} refused (503) "
            f"in {wall:.1f}s; per create p50 {p50:.1f}s p99 {p99:.1f}s max {times[-1]:.1f}s"
        )
        for exc in refused:
            assert "no capacity" in str(exc), exc
        assert made, "no create succeeded"
        assert times[-1] < CREATE_BOUND_S
        assert len(_sandbox_dirs(home)) == len(made)

        with ThreadPoolExecutor(8) as pool:
            killed = list(pool.map(lambda s: s.kill(), made))
        assert all(killed)
        assert not _sandbox_dirs(home), "killed sandboxes left their dirs"
        # What still runs is the warm pool (at most `warm_high` entries for the one shape);
        # a sandbox taken from it keeps its QEMU's first name under `warm/`, so count all.
        assert len(qemu_processes(home, warm=True)) <= 2, "killed sandboxes left VMs"
        with httpx.Client(
            base_url=srv.url, headers={"X-API-Key": srv.api_key}, timeout=REQUEST_TIMEOUT_S
        ) as api:
            assert api.get("/v2/sandboxes").json() == []
    finally:
        stop_and_check(srv)
