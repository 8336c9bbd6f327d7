"""Find the sandbox a signed ``/files`` URL is for when the URL does not name it.

With ``E2B_SANDBOX_URL`` set, the SDKs (Python 2.63, JS 2.51) build ``download_url()`` and
``upload_url()`` as ``<that URL's origin>/files?path=…&username=…&signature=…
[&signature_expiration=…]``: no sandbox id, no routing header, and a browser or curl that
gets the URL sends nothing else. The only per-sandbox part is the signature, SHA-256 over
``path:operation:user:<envd access token>[:expiration]``, so the sandbox is the one whose token
reproduces it. That costs one hash per live sandbox of this server that has a token (about
1.3 ms per 1000, measured on a 2-core host), bounded by what one node can run, and nothing
for a URL seen before (a small cache). The host form (``--domain``: ``https://49983-<id>.<domain>/files``)
never gets here. envd still checks the signature and its expiry itself; this only routes.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable
from urllib.parse import parse_qsl

SIGNATURE_PREFIX = "v1_"
_CACHE_SIZE = 4096

# (sandbox id, envd access token) of every live sandbox that has a token (the store's rows:
# async, a shared store answers over the network).
Candidates = Callable[[], Awaitable[Iterable[tuple[str, str]]]]
# The current envd token of one sandbox, or None.
TokenOf = Callable[[str], Awaitable[str | None]]


def _decode(signature: str) -> bytes | None:
    if not signature.startswith(SIGNATURE_PREFIX):
        return None
    body = signature[len(SIGNATURE_PREFIX) :]
    try:
        raw = base64.b64decode(body + "=" * (-len(body) % 4), validate=True)
    except (binascii.Error, ValueError):
        return None
    return raw if len(raw) == hashlib.sha256().digest_size else None


class SignedUrls:
    def __init__(self, candidates: Candidates, token_of: TokenOf) -> None:
        self._candidates = candidates
        self._token_of = token_of
        self._cache: OrderedDict[bytes, str] = OrderedDict()

    async def find(self, method: str, query: str) -> str | None:
        """The id of the sandbox whose envd token made this URL's signature, or None."""
        params = dict(parse_qsl(query, keep_blank_values=True))
        wanted = _decode(params.get("signature", ""))
        if wanted is None:
            return None
        # envd's rule: GET reads, every other method writes.
        op = "read" if method == "GET" else "write"
        # Byte for byte what envd hashes (`guest.envd.app._signature`).
        path = params.get("path", "")
        user = params.get("username", "")
        expiration = params.get("signature_expiration", "")
        if expiration:
            # envd hashes the number as it parsed, as upstream's does.
            try:
                expiration = str(int(expiration))
            except ValueError:
                return None

        # The hash state after `path:op:user:` is shared by every candidate.
        head = hashlib.sha256(f"{path}:{op}:{user}:".encode())
        tail = f":{expiration}".encode() if expiration else b""

        def made_by(token: str) -> bool:
            h = head.copy()
            h.update(token.encode())
            h.update(tail)
            return hmac.compare_digest(h.digest(), wanted)

        cached = self._cache.get(wanted)
        if cached is not None:
            token = await self._token_of(cached)
            if token is not None and made_by(token):
                self._cache.move_to_end(wanted)
                return cached
            del self._cache[wanted]
        for sandbox_id, token in await self._candidates():
            if made_by(token):
                self._cache[wanted] = sandbox_id
                if len(self._cache) > _CACHE_SIZE:
                    self._cache.popitem(last=False)
                return sandbox_id
        return None
