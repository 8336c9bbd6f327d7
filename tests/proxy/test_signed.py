"""Finding the sandbox of a signed /files URL that names none, with signatures made by the
SDK's own `get_signature` (what `download_url()`/`upload_url()` put in the URL)."""

from __future__ import annotations

import time
from urllib.parse import urlencode

from e2b import get_signature

from agentenv.proxy.signed import SignedUrls

TOKENS = {f"isandbox{i}": f"token-{i}" for i in range(50)}


def query(path: str, op: str, user: str | None, token: str, expires_in: int | None) -> str:
    sig = get_signature(path, op, user, token, expires_in)  # type: ignore[arg-type]
    q = {"path": path}
    if user:
        q["username"] = user
    q["signature"] = sig["signature"]
    if sig["expiration"]:
        q["signature_expiration"] = str(sig["expiration"])
    return urlencode(q)


def urls(tokens: dict[str, str] | None = None) -> tuple[SignedUrls, list[int]]:
    tokens = TOKENS if tokens is None else tokens
    scans = [0]

    async def candidates() -> list[tuple[str, str]]:
        scans[0] += 1
        return list(tokens.items())

    async def token_of(sandbox_id: str) -> str | None:
        return tokens.get(sandbox_id)

    return SignedUrls(candidates, token_of), scans


async def test_the_signing_sandbox_is_found_for_reads_and_writes() -> None:
    signed, _ = urls()
    path = "/home/user/a file+ü.txt"
    assert await signed.find("GET", query(path, "read", None, "token-7", None)) == "isandbox7"
    assert await signed.find("POST", query(path, "write", "root", "token-31", 60)) == "isandbox31"
    assert await signed.find("PUT", query(path, "write", None, "token-2", None)) == "isandbox2"


async def test_wrong_operation_token_or_tampering_finds_nothing() -> None:
    signed, _ = urls()
    read = query("/etc/hosts", "read", None, "token-3", None)
    assert await signed.find("POST", read) is None  # a read signature does not allow a write
    assert await signed.find("GET", query("/etc/hosts", "read", None, "not-a-token", None)) is None
    assert await signed.find("GET", read.replace("hosts", "passwd")) is None
    assert await signed.find("GET", "path=%2Fetc%2Fhosts&signature=garbage") is None
    assert await signed.find("GET", "path=%2Fetc%2Fhosts") is None


async def test_an_expired_url_still_routes_so_envd_can_refuse_it() -> None:
    # The expiry is part of what was signed; envd answers 401 for it, as E2B's does.
    signed, _ = urls()
    q = query("/tmp/x", "read", None, "token-9", -30)
    assert int(dict(p.split("=") for p in q.split("&"))["signature_expiration"]) < time.time()
    assert await signed.find("GET", q) == "isandbox9"


async def test_a_url_seen_before_is_not_matched_again_and_a_gone_sandbox_is_forgotten() -> None:
    tokens = dict(TOKENS)
    signed, scans = urls(tokens)
    q = query("/tmp/x", "read", None, "token-4", None)
    assert await signed.find("GET", q) == "isandbox4" and scans == [1]
    assert await signed.find("GET", q) == "isandbox4" and scans == [1]
    del tokens["isandbox4"]
    assert await signed.find("GET", q) is None and scans == [2]


async def test_matching_a_full_node_is_cheap() -> None:
    many = {f"i{i:019d}": f"tok-{i:040d}" for i in range(2000)}
    signed, _ = urls(many)
    misses = [query(f"/tmp/{n}", "read", None, "unknown", None) for n in range(20)]
    started = time.perf_counter()
    for q in misses:
        assert await signed.find("GET", q) is None
    per_scan_ms = (time.perf_counter() - started) / len(misses) * 1000
    print(f"signed URL with no match, 2000 sandboxes: {per_scan_ms:.2f} ms")
    # Loose: a few ms on a busy 2-core host; seconds would mean something quadratic.
    assert per_scan_ms < 100
