"""Registry authentication: anonymous, HTTP basic, and bearer tokens from a challenge.

A registry that wants credentials answers 401 with ``WWW-Authenticate``. ``Basic`` means
send the username and password on every request. ``Bearer realm=...,service=...,scope=...``
means fetch a token from the realm (the distribution token spec: a GET with ``service`` and
``scope`` query parameters, basic credentials if we have any, anonymous otherwise) and send
it as ``Authorization: Bearer``. Tokens are cached per (realm, service, scope) until a few
seconds before they expire (the spec's default lifetime is 60 s), so the layers of one pull
share one token per repository.
"""

from __future__ import annotations

import base64
import re
import time
from dataclasses import dataclass

import httpx

from agentenv.oci.errors import RegistryError, Unauthorized

DEFAULT_TOKEN_LIFETIME_S = 60
# Renew this long before expiry, so a token never runs out in the middle of a request.
EXPIRY_MARGIN_S = 5

_PARAM = re.compile(r'\s*([A-Za-z0-9_-]+)\s*=\s*(?:"((?:[^"\\]|\\.)*)"|([^\s,]*))\s*,?')


@dataclass(frozen=True)
class Credentials:
    username: str
    password: str

    def basic_header(self) -> str:
        raw = f"{self.username}:{self.password}".encode()
        return "Basic " + base64.b64encode(raw).decode()

    def __repr__(self) -> str:  # never print a password
        return f"Credentials(username={self.username!r}, password=***)"


@dataclass(frozen=True)
class Challenge:
    scheme: str  # lowercased: "basic" or "bearer"
    params: dict[str, str]


def parse_challenges(header: str) -> list[Challenge]:
    """Every challenge in a ``WWW-Authenticate`` value (``Bearer realm="…",scope="…"``)."""
    out: list[Challenge] = []
    rest = header.strip()
    while rest:
        m = re.match(r"([A-Za-z][A-Za-z0-9_-]*)\s*", rest)
        if not m:
            break
        scheme = m.group(1).lower()
        rest = rest[m.end() :]
        params: dict[str, str] = {}
        while True:
            pm = _PARAM.match(rest)
            # A bare word not followed by '=' starts the next challenge.
            if not pm:
                break
            value = pm.group(2)
            value = re.sub(r"\\(.)", r"\1", value) if value is not None else pm.group(3)
            params[pm.group(1).lower()] = value
            rest = rest[pm.end() :]
        out.append(Challenge(scheme, params))
        rest = rest.lstrip(", ")
    return out


@dataclass
class _Token:
    value: str
    expires_at: float


class Authenticator:
    """Per-host credentials and the tokens obtained with them, shared by all requests."""

    def __init__(self, credentials: dict[str, Credentials] | None = None) -> None:
        self._credentials = dict(credentials or {})
        self._tokens: dict[tuple[str, str, str], _Token] = {}
        # What each host asked for last time: lets later requests authenticate up front.
        self._schemes: dict[str, Challenge] = {}
        self.token_requests = 0

    def credentials_for(self, host: str) -> Credentials | None:
        return self._credentials.get(host)

    def header(self, host: str, scope: str) -> str | None:
        """An Authorization value for `host` and `scope` that needs no round trip, if any."""
        challenge = self._schemes.get(host)
        if challenge is None:
            return None
        creds = self.credentials_for(host)
        if challenge.scheme == "basic":
            return creds.basic_header() if creds else None
        token = self._tokens.get(self._token_key(challenge, scope))
        if token is not None and token.expires_at > time.monotonic():
            return "Bearer " + token.value
        return None

    @staticmethod
    def _token_key(challenge: Challenge, scope: str) -> tuple[str, str, str]:
        return (challenge.params.get("realm", ""), challenge.params.get("service", ""), scope)

    async def answer(
        self, http: httpx.AsyncClient, host: str, scope: str, response: httpx.Response, what: str
    ) -> str:
        """The Authorization value that answers the 401 `response`; Unauthorized if none."""
        raw = response.headers.get("www-authenticate", "")
        challenges = parse_challenges(raw)
        creds = self.credentials_for(host)
        for challenge in challenges:
            if challenge.scheme == "bearer" and "realm" in challenge.params:
                self._schemes[host] = challenge
                return "Bearer " + await self._fetch_token(http, challenge, scope, creds, what)
        for challenge in challenges:
            if challenge.scheme == "basic":
                self._schemes[host] = challenge
                if creds is None:
                    raise Unauthorized(f"{what}: {host} wants a username and password")
                return creds.basic_header()
        raise Unauthorized(f"{what}: {host} answered 401 with no usable challenge ({raw!r})")

    def forget(self, host: str, scope: str) -> None:
        """Drop a token the registry refused, so the next try asks for a new one."""
        challenge = self._schemes.get(host)
        if challenge is not None:
            self._tokens.pop(self._token_key(challenge, scope), None)

    async def _fetch_token(
        self,
        http: httpx.AsyncClient,
        challenge: Challenge,
        scope: str,
        creds: Credentials | None,
        what: str,
    ) -> str:
        key = self._token_key(challenge, scope)
        cached = self._tokens.get(key)
        if cached is not None and cached.expires_at > time.monotonic():
            return cached.value
        realm = challenge.params["realm"]
        params = {"scope": scope}
        if "service" in challenge.params:
            params["service"] = challenge.params["service"]
        headers = {"Authorization": creds.basic_header()} if creds else {}
        self.token_requests += 1
        try:
            resp = await http.get(realm, params=params, headers=headers)
        except httpx.HTTPError as exc:
            raise RegistryError(f"{what}: token service {realm} failed: {exc!r}") from None
        if resp.status_code in (401, 403):
            who = f"user {creds.username!r}" if creds else "anonymous access"
            raise Unauthorized(f"{what}: token service {realm} refused {who} for {scope}")
        if resp.status_code != 200:
            raise RegistryError(f"{what}: token service {realm} answered {resp.status_code}")
        try:
            doc = resp.json()
            value = str(doc.get("token") or doc.get("access_token") or "")
            lifetime = int(doc.get("expires_in") or DEFAULT_TOKEN_LIFETIME_S)
        except (ValueError, TypeError, AttributeError):
            raise RegistryError(f"{what}: token service {realm} sent no JSON token") from None
        if not value:
            raise RegistryError(f"{what}: token service {realm} sent an empty token")
        lifetime = max(lifetime, DEFAULT_TOKEN_LIFETIME_S)
        self._tokens[key] = _Token(value, time.monotonic() + lifetime - EXPIRY_MARGIN_S)
        return value
