"""Host memory of a sandbox through the server: `hostMemoryPssMB` on the detail, the list and
the metrics sample, and a Prometheus series per running sandbox that ends with it."""

from __future__ import annotations

import re

import httpx
import pytest

pytestmark = pytest.mark.vm


def _series(api: httpx.Client, sandbox_id: str) -> float | None:
    text = api.get("/metrics").text
    m = re.search(
        rf'^agentenv_sandbox_host_pss_bytes{{sandbox_id="{sandbox_id}"}} (\S+)$', text, re.M
    )
    return None if m is None else float(m.group(1))


def test_host_pss_on_detail_list_metrics_and_prometheus(api: httpx.Client) -> None:
    resp = api.post("/sandboxes", json={"templateID": "base", "timeout": 300})
    assert resp.status_code == 201, resp.text
    sid = resp.json()["sandboxID"]
    try:
        detail = api.get(f"/sandboxes/{sid}").json()
        pss = detail["hostMemoryPssMB"]
        assert 0 < pss < detail["memoryMB"], detail
        listed = {r["sandboxID"]: r for r in api.get("/v2/sandboxes").json()}
        assert listed[sid]["hostMemoryPssMB"] > 0
        samples = api.get(f"/sandboxes/{sid}/metrics").json()
        assert samples and samples[0]["hostMemoryPssMB"] > 0
        series = _series(api, sid)
        assert series is not None and series > 0
    finally:
        assert api.delete(f"/sandboxes/{sid}").status_code == 204
    assert _series(api, sid) is None, "the series ends with the sandbox"
