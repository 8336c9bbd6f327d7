"""The single-port routing order of e2b-protocol §1.4."""

from __future__ import annotations

import pytest

from agentenv.proxy.routing import CONTROL, BadRoute, Sandbox, normalise_path, route

SID = "iabc123"


def hdrs(**kw: str) -> dict[str, str]:
    return {k.replace("_", "-"): v for k, v in kw.items()}


@pytest.mark.parametrize(
    ("method", "path", "headers", "expected"),
    [
        ("POST", "/v2/sandboxes", {}, CONTROL),
        ("GET", "/sandboxes/x", {}, CONTROL),
        # SDK 2.10 leaks sandbox headers on connect: the control-plane path still wins.
        (
            "POST",
            "/sandboxes/x/connect",
            hdrs(e2b_sandbox_id=SID, e2b_sandbox_port="49983"),
            CONTROL,
        ),
        ("GET", "/health", {}, CONTROL),
        ("GET", "/metrics", {}, CONTROL),
        ("GET", "/health", hdrs(e2b_sandbox_id=SID), Sandbox(SID, 49983, "/health")),
        ("GET", "/metrics", hdrs(e2b_sandbox_id=SID), Sandbox(SID, 49983, "/metrics")),
        (
            "POST",
            "/process.Process/Start",
            hdrs(e2b_sandbox_id=SID, e2b_sandbox_port="49983"),
            Sandbox(SID, 49983, "/process.Process/Start"),
        ),
        (
            "GET",
            "/index.html",
            hdrs(e2b_sandbox_id=SID, e2b_sandbox_port="8080", host="8081-iother.x.test"),
            Sandbox(SID, 8080, "/index.html"),
        ),
        # E2B_SANDBOX_URL=http://H:P/proxy: the SDK keeps the prefix on envd calls.
        (
            "POST",
            "/proxy/process.Process/Start",
            hdrs(e2b_sandbox_id=SID, e2b_sandbox_port="49983"),
            Sandbox(SID, 49983, "/process.Process/Start"),
        ),
        (
            "GET",
            "/proxy/app",
            hdrs(e2b_sandbox_id=SID, e2b_sandbox_port="3000"),
            Sandbox(SID, 3000, "/proxy/app"),
        ),
        ("GET", "/a?b", hdrs(host="8080-iabc123.sbx.test:8000"), Sandbox(SID, 8080, "/a?b")),
        ("GET", "/proxy/iabc123/3000/x/y", {}, Sandbox(SID, 3000, "/x/y")),
        ("GET", "/proxy/iabc123/3000", {}, Sandbox(SID, 3000, "/")),
        (
            "GET",
            "/files",
            hdrs(host="127.0.0.1:8000"),
            BadRoute(404, "route not found: GET /files"),
        ),
    ],
)
def test_route(method: str, path: str, headers: dict[str, str], expected: object) -> None:
    assert route(method, path, headers) == expected


@pytest.mark.parametrize("port", ["0", "65536", "http", "-1"])
def test_bad_port_header_is_a_400(port: str) -> None:
    got = route("GET", "/files", hdrs(e2b_sandbox_id=SID, e2b_sandbox_port=port))
    assert isinstance(got, BadRoute) and got.status == 400


def test_double_slash_from_a_trailing_slash_base_url_is_normalised() -> None:
    assert normalise_path("//process.Process/Start") == "/process.Process/Start"
    assert normalise_path("/files") == "/files"
