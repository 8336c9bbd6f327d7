"""Single-port routing: decide whether a request is for the control plane or a sandbox.

Order (see docs e2b-protocol §1.4): a ``{port}-{sandboxID}.{domain}`` host under the server's
own domain (`--domain`) names a sandbox whatever the path; then a known control-plane route
wins even when sandbox headers are present (SDK 2.10 leaks them on connect); then the
``e2b-sandbox-id``/``e2b-sandbox-port`` headers, where ``GET /health`` and ``/metrics`` with a
sandbox id go to the sandbox; then a ``{port}-{sandboxID}.`` host under any domain; then a
``/proxy/{id}/{port}/…`` path; last a signed ``/files`` URL that names no sandbox (what
``download_url()``/``upload_url()`` build from ``E2B_SANDBOX_URL``), which the caller resolves
by its signature (`proxy.signed`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from agentenv.ports import ENVD_PORT

CODE_INTERPRETER_PORT = 49999
SDK_PORTS = frozenset((ENVD_PORT, CODE_INTERPRETER_PORT))

SANDBOX_ID_HEADERS = ("e2b-sandbox-id", "x-agentenv-sandbox-id")
SANDBOX_PORT_HEADERS = ("e2b-sandbox-port", "x-agentenv-sandbox-port")
TRAFFIC_TOKEN_HEADER = "e2b-traffic-access-token"
# Routing headers are consumed here and never reach the sandbox.
ROUTING_HEADERS = frozenset((*SANDBOX_ID_HEADERS, *SANDBOX_PORT_HEADERS, TRAFFIC_TOKEN_HEADER))

_SEG = r"[^/]+"
_CONTROL_PATTERNS: tuple[tuple[frozenset[str], re.Pattern[str]], ...] = tuple(
    (frozenset(methods.split()), re.compile(f"^{pattern}$"))
    for methods, pattern in (
        ("GET POST", "/sandboxes"),
        ("GET", "/sandboxes/metrics"),
        ("GET DELETE", f"/sandboxes/{_SEG}"),
        (
            "POST",
            f"/sandboxes/{_SEG}/(?:timeout|pause|resume|connect|snapshots|fork|refreshes|reset)",
        ),
        ("GET", f"/sandboxes/{_SEG}/(?:metrics|logs)"),
        ("PUT", f"/sandboxes/{_SEG}/network"),
        ("GET POST", "/v2/sandboxes"),
        ("POST", f"/v2/sandboxes/{_SEG}/connect"),
        ("GET", f"/v2/sandboxes/{_SEG}/logs"),
        ("GET", "/snapshots"),
        ("POST", f"/snapshots/{_SEG}/fork"),
        ("GET POST PUT PATCH DELETE", "/(?:v2/|v3/)?templates(?:/.*)?"),
        ("GET POST PUT PATCH DELETE", "/(?:volumes|secrets)(?:/.*)?"),
        # Our own endpoints. /health and /metrics are the server's only without a sandbox id.
        ("GET", "/nodes"),
        ("GET", f"/nodes/{_SEG}"),
        ("POST", f"/nodes/{_SEG}/(?:cordon|uncordon|drain)"),
        ("GET", "/openapi.json"),
        ("GET", "/docs"),
    )
)
# The first path segment of every pattern above: a path that starts otherwise (every envd
# path) is no control route, found without trying each pattern.
_CONTROL_HEADS = frozenset(
    [
        "sandboxes",
        "v2",
        "v3",
        "snapshots",
        "templates",
        "volumes",
        "secrets",
        "nodes",
        "openapi.json",
        "docs",
    ]
)
_SERVER_ONLY_PATHS = frozenset(("/health", "/metrics"))
_HOST_RE = re.compile(r"^(\d{1,5})-([a-z0-9]+)\.")
_DOMAIN_HOST_RE = re.compile(r"^(\d{1,5})-([a-z0-9]+)\.(.+?)(?::\d{1,5})?$")
# envd's file transfer path; the only one a signed URL without a sandbox id can name.
FILES_PATH = "/files"
_PROXY_PATH_RE = re.compile(r"^/proxy/([a-z0-9]+)/(\d{1,5})(/.*)?$")


@dataclass(frozen=True)
class Control:
    """Dispatch to the control-plane app."""


@dataclass(frozen=True)
class Sandbox:
    sandbox_id: str
    port: int
    # Path to send upstream (differs from the request path for /proxy/… routing).
    path: str


@dataclass(frozen=True)
class BadRoute:
    status: int
    message: str


@dataclass(frozen=True)
class SignedFiles:
    """A ``/files`` request that names no sandbox but carries a signature: the sandbox is the
    one whose envd token made it (`proxy.signed.SignedUrls`)."""


Route = Control | Sandbox | SignedFiles | BadRoute

CONTROL = Control()


def is_control_route(method: str, path: str) -> bool:
    # The method is not part of the match: a wrong method on a control path should get the
    # control plane's 405, and no data-plane path shares these prefixes.
    del method
    if path[1:].partition("/")[0] not in _CONTROL_HEADS:
        return False
    return any(rx.match(path) for _, rx in _CONTROL_PATTERNS)


def normalise_path(path: str) -> str:
    # connectrpc joins a trailing-slash base URL into `//process.Process/Start`.
    while path.startswith("//"):
        path = path[1:]
    return path


def route(
    method: str,
    path: str,
    headers: dict[str, str],
    *,
    domain: str | None = None,
    signed: bool = False,
) -> Route:
    """``headers`` has lowercase names; ``path`` is already normalised; ``domain`` is the
    server's sandbox domain; ``signed``: the query string has a ``signature``."""
    host = headers.get("host", "")
    if domain and (target := _domain_host(host, path, domain)) is not None:
        return target
    if is_control_route(method, path):
        return CONTROL
    sandbox_id = next((headers[h] for h in SANDBOX_ID_HEADERS if headers.get(h)), None)
    if sandbox_id:
        raw_port = next((headers[h] for h in SANDBOX_PORT_HEADERS if headers.get(h)), None)
        port = _parse_port(raw_port) if raw_port is not None else ENVD_PORT
        if port is None:
            return BadRoute(400, f"invalid sandbox port {raw_port!r}")
        return Sandbox(sandbox_id, port, _strip_sdk_prefix(path, port))
    # A sandbox host is the data plane even for /health: a user app may serve that path.
    if m := _HOST_RE.match(host):
        port = _parse_port(m.group(1))
        if port is None:
            return BadRoute(400, f"invalid sandbox port in host {host!r}")
        return Sandbox(m.group(2), port, path)
    if path in _SERVER_ONLY_PATHS:
        return CONTROL
    if m := _PROXY_PATH_RE.match(path):
        port = _parse_port(m.group(2))
        if port is None:
            return BadRoute(400, f"invalid sandbox port {m.group(2)!r}")
        return Sandbox(m.group(1), port, m.group(3) or "/")
    if path == FILES_PATH:
        if signed:
            return SignedFiles()
        return BadRoute(
            404,
            f"route not found: {method} {path} names no sandbox: send the e2b-sandbox-id "
            "header, or use the sandbox's host ({port}-{sandboxID}.{domain})",
        )
    return BadRoute(404, f"route not found: {method} {path}")


def _domain_host(host: str, path: str, domain: str) -> Route | None:
    m = _DOMAIN_HOST_RE.match(host.lower())
    if m is None or m.group(3) != domain.lower().rstrip("."):
        return None
    port = _parse_port(m.group(1))
    if port is None:
        return BadRoute(400, f"invalid sandbox port in host {host!r}")
    return Sandbox(m.group(2), port, path)


def _strip_sdk_prefix(path: str, port: int) -> str:
    """Drop the ``/proxy`` prefix an SDK adds when ``E2B_SANDBOX_URL`` ends in ``/proxy``.

    Only for envd and the code interpreter, whose paths are known; a user app keeps its path.
    """
    if port in SDK_PORTS and path.startswith("/proxy/") and not _PROXY_PATH_RE.match(path):
        return path[len("/proxy") :]
    return path


def _parse_port(raw: str) -> int | None:
    try:
        port = int(raw)
    except ValueError:
        return None
    return port if 1 <= port <= 65535 else None
