"""`download_url()` / `upload_url()` of the unmodified SDK with only `E2B_API_URL` and
`E2B_SANDBOX_URL` set (the README's setup): the URLs name no sandbox, the server finds it by
the signature (`proxy.signed`), envd checks signature and expiry."""

from __future__ import annotations

import time
from urllib.parse import parse_qs, urlencode, urlsplit

import httpx
import pytest
from api.conftest import REQUEST_TIMEOUT_S
from e2b import Sandbox

from agentenv.api.devserver import ServerProcess

pytestmark = pytest.mark.vm


def create(srv: ServerProcess) -> Sandbox:
    return Sandbox.create(
        template="base",
        timeout=600,
        api_key=srv.api_key,
        api_url=srv.url,
        sandbox_url=srv.url,
        request_timeout=REQUEST_TIMEOUT_S,
    )


def with_query(url: str, **changes: str) -> str:
    parts = urlsplit(url)
    query = {k: v[0] for k, v in parse_qs(parts.query, keep_blank_values=True).items()}
    query.update(changes)
    return parts._replace(query=urlencode(query)).geturl()


def test_signed_urls_reach_the_sandbox_that_signed_them(server: ServerProcess) -> None:
    a, b = create(server), create(server)
    try:
        path = "/home/user/shared name.txt"
        contents = {a.sandbox_id: b"written through a's upload URL", b.sandbox_id: b"b's"}
        with httpx.Client(timeout=60) as http:
            for sbx in (a, b):
                url = sbx.upload_url(path)
                # Nothing in the URL names the sandbox: only the signature tells them apart.
                assert url.startswith(f"{server.url}/files?") and sbx.sandbox_id not in url
                resp = http.post(url, files={"file": ("ignored", contents[sbx.sandbox_id])})
                assert resp.status_code == 200, resp.text
                assert resp.json()[0]["path"] == path
            for sbx in (a, b):
                got = http.get(sbx.download_url(path))
                assert got.status_code == 200, got.text
                assert got.content == contents[sbx.sandbox_id]
                assert sbx.files.read(path, format="bytes") == contents[sbx.sandbox_id]

            # A user and an expiry are part of what is signed.
            url = a.upload_url("/tmp/as-root.txt", user="root", use_signature_expiration=120)
            assert http.post(url, files={"file": ("x", b"root's")}).status_code == 200
            owner = a.commands.run("stat -c %U /tmp/as-root.txt").stdout.strip()
            assert owner == "root"
            url = a.download_url(path, use_signature_expiration=120)
            assert http.get(url).content == contents[a.sandbox_id]

            # Expired: routed to the sandbox by its signature, refused by envd (401).
            short = a.download_url(path, use_signature_expiration=1)
            time.sleep(2.5)
            expired = http.get(short)
            assert expired.status_code == 401 and "expired" in expired.text, expired.text

            # Wrong signatures match no sandbox: 401 from the server, nothing reaches envd.
            good = a.download_url(path)
            sig = parse_qs(urlsplit(good).query)["signature"][0]
            tampered = sig[:-2] + ("AA" if not sig.endswith("AA") else "BB")
            for bad in (
                with_query(good, signature=tampered),
                with_query(good, path="/etc/shadow"),
                with_query(good, signature="v1_not-base64!"),
            ):
                refused = http.get(bad)
                assert refused.status_code == 401, (bad, refused.text)
                assert refused.json()["code"] == 401
            # A read signature does not upload.
            refused = http.post(good, files={"file": ("x", b"no")})
            assert refused.status_code == 401
            # Without a signature a bare /files names nothing: 404 saying what to send.
            bare = http.get(f"{server.url}/files", params={"path": path})
            assert bare.status_code == 404 and "e2b-sandbox-id" in bare.text

            b_url = b.download_url(path)
            b.kill()
            gone = http.get(b_url)
            assert gone.status_code == 401, gone.text
            assert http.get(a.download_url(path)).status_code == 200
    finally:
        for sbx in (a, b):
            sbx.kill()
