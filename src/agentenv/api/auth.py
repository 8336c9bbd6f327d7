"""Who is calling: the API key a request carries, checked against the control app's key ring.

Its own module so the control routes, the template build routes and the build progress route
all authenticate the same way without importing one another.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Header, Request

from agentenv.api.keys import KeyRing
from agentenv.control.store import ApiKey


class ApiError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


async def api_key(
    request: Request,
    x_api_key: Annotated[str | None, Header()] = None,
    authorization: Annotated[str | None, Header()] = None,
) -> ApiKey:
    secret = x_api_key
    if not secret and authorization and authorization.lower().startswith("bearer "):
        secret = authorization[7:].strip()
    if not secret:
        raise ApiError(401, "missing API key: send it in the X-API-Key header")
    keys: KeyRing = request.app.state.ctx.keys
    key = await keys.verify(secret)
    if key is None:
        raise ApiError(401, "invalid API key")
    return key


Auth = Annotated[ApiKey, Depends(api_key)]
