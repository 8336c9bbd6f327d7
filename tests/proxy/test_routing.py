"""The single-port routing order of e2b-protocol §1.4."""

from __future__ import annotations

import pytest

from agentenv.proxy.routing import (
    _CONTROL_PATTERNS,
    CONTROL,
    BadRoute,
    Sandbox,
    SignedFiles,
    is_control_route,
    normalise_path,
    route,
)

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
        ("GET", "/nodes", {}, CONTROL),
        ("GET", "/nodes/node-a", {}, CONTROL),
        ("POST", "/nodes/node-a/drain", {}, CONTROL),
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
        # A sandbox host is the data plane even for the server's own paths.
        ("GET", "/health", hdrs(host="8080-iabc123.any.test"), Sandbox(SID, 8080, "/health")),
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


def test_files_without_a_sandbox_is_signed_or_a_404() -> None:
    unsigned = route("GET", "/files", hdrs(host="127.0.0.1:8000"))
    assert isinstance(unsigned, BadRoute) and unsigned.status == 404
    assert "{port}-{sandboxID}.{domain}" in unsigned.message
    assert route("GET", "/files", hdrs(host="127.0.0.1:8000"), signed=True) == SignedFiles()
    assert route("POST", "/files", {}, signed=True) == SignedFiles()
    # Headers name the sandbox: the signature is envd's business, not routing's.
    with_id = route("GET", "/files", hdrs(e2b_sandbox_id=SID), signed=True)
    assert with_id == Sandbox(SID, 49983, "/files")


@pytest.mark.parametrize(
    ("method", "path", "host", "expected"),
    [
        # Under the server's domain the host wins over control-plane paths and headers.
        ("GET", "/sandboxes", "8080-iabc123.sbx.test", Sandbox(SID, 8080, "/sandboxes")),
        ("GET", "/health", "49983-iabc123.SBX.test:443", Sandbox(SID, 49983, "/health")),
        ("GET", "/files", "49983-iabc123.sbx.test", Sandbox(SID, 49983, "/files")),
        # The API host under the same wildcard is the control plane.
        ("GET", "/sandboxes", "api.sbx.test", CONTROL),
        # Another domain keeps the usual order: control-plane paths first.
        ("GET", "/sandboxes", "8080-iabc123.other.test", CONTROL),
        (
            "GET",
            "/x",
            "70000-iabc123.sbx.test",
            BadRoute(400, "invalid sandbox port in host '70000-iabc123.sbx.test'"),
        ),
    ],
)
def test_domain_host_routing(method: str, path: str, host: str, expected: object) -> None:
    headers = hdrs(host=host, e2b_sandbox_id="iother")
    assert route(method, path, headers, domain="sbx.test") == expected


# One path per control route pattern (a pattern added without one fails the first check).
CONTROL_SAMPLES = (
    "/sandboxes",
    "/sandboxes/metrics",
    "/sandboxes/abc",
    "/sandboxes/abc/reset",
    "/sandboxes/abc/logs",
    "/sandboxes/abc/network",
    "/v2/sandboxes",
    "/v2/sandboxes/abc/connect",
    "/v2/sandboxes/abc/logs",
    "/snapshots",
    "/snapshots/abc/fork",
    "/v3/templates/t/builds",
    "/secrets",
    "/nodes",
    "/nodes/n",
    "/nodes/n/drain",
    "/openapi.json",
    "/docs",
)


def test_the_first_segment_check_agrees_with_every_control_pattern() -> None:
    for _, rx in _CONTROL_PATTERNS:
        assert any(rx.match(p) for p in CONTROL_SAMPLES), rx.pattern
    assert all(is_control_route("GET", p) for p in CONTROL_SAMPLES)
    for path in ("/process.Process/Start", "/files", "/health", "/sandboxesx", "/", ""):
        assert not is_control_route("POST", path), path
