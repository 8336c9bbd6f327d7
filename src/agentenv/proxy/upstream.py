"""What a proxied request becomes upstream: the headers that stop at the proxy, the TLS of
a guest's own HTTPS port, the host and scheme of a sandbox port, the raw target
path, and the bodies of a refusal (a sandbox not found, or paused). Split from
`forward.py`: the rules, apart from the relaying."""

from __future__ import annotations

import re
import ssl
from typing import Any
from urllib.parse import unquote

from agentenv.control.store import SandboxRecord, SandboxState
from agentenv.ports import ENVD_PORT
from agentenv.proxy.wire import Scope

HOP_BY_HOP = frozenset(
    (
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
    )
)

WS_OWN_HEADERS = frozenset(
    (
        "host",
        "sec-websocket-key",
        "sec-websocket-version",
        "sec-websocket-extensions",
        "sec-websocket-protocol",
        "sec-websocket-accept",
    )
)

# `network.maskRequestHost`: E2B's placeholder for the sandbox port the request is for.
MASK_PORT_PLACEHOLDER = "${PORT}"
# A Host value we can put into a WebSocket URI as is (name or [v6], optional port).
_AUTHORITY_RE = re.compile(r"^(?:[A-Za-z0-9._-]+|\[[0-9A-Fa-f:.]+\])(?::\d{1,5})?$")


def valid_authority(value: str) -> bool:
    return len(value) <= 260 and _AUTHORITY_RE.match(value) is not None


def _unverified_tls() -> ssl.SSLContext:
    # `network.httpsPorts`: the guest's own server speaks TLS with whatever certificate it
    # has (self-signed, usually); the hop is host → its own slot, so nothing is verified.
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    return ctx


UPSTREAM_TLS = _unverified_tls()


def upstream_host(rec: SandboxRecord, port: int, incoming: str) -> tuple[str, str | None]:
    """The Host header the guest sees, and the X-Forwarded-Host to add (or None).

    As E2B's proxy: the client's own Host passes through, unless the sandbox was created
    with `network.maskRequestHost`; then a request for any port but envd's carries the mask
    (``${PORT}`` = that port) and the client's Host moves to X-Forwarded-Host."""
    mask = rec.network.get("maskRequestHost")
    if port == ENVD_PORT or not isinstance(mask, str) or not mask:
        return incoming, None
    return mask.replace(MASK_PORT_PLACEHOLDER, str(port)), incoming


def https_port(rec: SandboxRecord, port: int) -> bool:
    ports = rec.network.get("httpsPorts") or ()
    return port in ports


def raw_target_path(scope: Scope, path: str) -> str:
    """`path` (the decoded path routing chose to send upstream: the request's, or what
    follows a `/proxy/{id}/{port}` prefix) as the client wrote it, percent-escapes kept.

    Forwarding the decoded form would change what the app receives: `%2F` would become a
    path separator, `%3F` and `%23` would start a query and a fragment. E2B's proxy (Go's
    reverse proxy) passes the escaped path on as sent. The raw form is the tail of the raw
    request path that decodes to `path`; without one (no raw path, or a rewritten one) the
    decoded path goes, as before."""
    raw = scope.get("raw_path")
    if not isinstance(raw, bytes) or not raw:
        return path
    text = raw.decode("utf-8", "replace")
    start = text.find("/")
    while start != -1:
        tail = text[start:]
        if unquote(tail) == path:
            return tail
        start = text.find("/", start + 1)
    return path


# A sandbox between two states (a reset or a resume loading its guest, a pause writing it
# out) is waited out, as E2B's API waits out a transition, and not refused: the refusal is the
# 502 "was not found", which the SDKs raise as "killed or timed out" of a sandbox that lives
# on. A reset or resume takes under a second on a quiet node, a pause of a large guest
# seconds; past the wait the answer is a 503 with Retry-After.
SETTLING = frozenset({SandboxState.RESUMING, SandboxState.PAUSING})
SETTLE_WAIT_S = 30.0


def waits_out(rec: SandboxRecord, now: float) -> bool:
    """Whether a request waits out `rec`'s transition. Not a pause that traffic will not
    undo (no auto-resume, no grace after a timeout): the wait would end in the same 502 "was
    not found", and an SDK's health probe (5 s) after a stream the pause cut would give up
    first and raise "could not be reached" instead of the sandbox's end."""
    if rec.state is not SandboxState.PAUSING:
        return True
    return rec.auto_resume or rec.grace_left(now) > 0


def not_found_body(sandbox_id: str, *, paused: bool = False) -> dict[str, Any]:
    # The SDK keys "sandbox not running" off the substring "was not found" in a 502.
    message = f"The sandbox {sandbox_id} was not found"
    if paused:
        message += ": it is paused and auto-resume is off for it; resume it with connect"
    return {"code": 502, "sandboxId": sandbox_id, "message": message}


def forwardable(rec: SandboxRecord | None) -> bool:
    return rec is not None and rec.state is SandboxState.RUNNING and rec.address is not None


def refusal(sandbox_id: str, rec: SandboxRecord | None) -> dict[str, Any]:
    return not_found_body(sandbox_id, paused=rec is not None and rec.state is SandboxState.PAUSED)


def unsettled(rec: SandboxRecord, waited_s: float) -> dict[str, Any]:
    """The answer to a request whose sandbox was still in a transition after the wait."""
    return {
        "code": 503,
        "message": f"sandbox {rec.id} is still {rec.state.value} after {waited_s:g}s "
        "(a reset, pause or resume under way); retry",
    }
