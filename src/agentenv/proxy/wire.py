"""ASGI plumbing shared by the router and the proxy."""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable, MutableMapping
from contextvars import ContextVar
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


async def send_json(
    send: Send, status: int, body: Any, headers: list[tuple[bytes, bytes]] | None = None
) -> None:
    payload = json.dumps(body, separators=(",", ":")).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(payload)).encode()),
                *(headers or []),
            ],
        }
    )
    await send({"type": "http.response.body", "body": payload, "more_body": False})


# Set in the request's context (the server awaits the app in it) by `abort_response`.
_ABORTED: ContextVar[bool] = ContextVar("agentenv_response_aborted", default=False)
# What uvicorn logs, as an error, for an app that returns mid-response.
_UNFINISHED = "ASGI callable returned without completing response"


class _IntendedAbort(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not (_ABORTED.get() and str(record.msg).startswith(_UNFINISHED))


def abort_response() -> None:
    """Have the server drop the client's connection under a response already started.

    ASGI has no message for it: the app returns without the final body message, and the
    server (uvicorn) closes the connection, so the client reads a cut body (an unfinished
    chunked body, a short sized one), which it cannot take for a complete response. The
    caller must return right after. uvicorn reports each such return as an error; here it is
    the intent, so that one line is left out (for this request only)."""
    _ABORTED.set(True)
    logger = logging.getLogger("uvicorn.error")
    if not any(isinstance(f, _IntendedAbort) for f in logger.filters):
        logger.addFilter(_IntendedAbort())
