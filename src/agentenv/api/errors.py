"""The API's one error map: every error leaves the HTTP API here, as ``{"code": int,
"message": str}`` with ``application/json`` (the SDK's generated client parses that body for
every documented error status and crashes on anything else).

What is mapped, and how:
- the contract's typed errors (`contract.errors.OrchestratorError` and its kinds) carry their
  status; a node at capacity adds `Retry-After`, which the SDK honours;
- `api.auth.ApiError`: the API's own refusals (auth, bad fields), with their status;
- FastAPI's validation errors: 400 naming the first bad field;
- routing misses: 404 / 405 naming the route;
- anything else: 500 naming only the exception's type (the traceback goes to the log).

Handlers return `error(...)` for expected answers; nothing else in `api/` builds error JSON.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from agentenv.api.auth import ApiError
from agentenv.contract.errors import OrchestratorError

log = logging.getLogger("agentenv.api")


def error(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"code": status, "message": message}, status_code=status, headers=headers)


def describe_invalid(exc: RequestValidationError) -> str:
    """The first validation error as `field: problem` (+ how many more)."""
    errs = exc.errors()
    if not errs:
        return "invalid request"
    first = errs[0]
    if first.get("type") == "json_invalid":
        return "request body is not valid JSON"
    loc = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
    msg = str(first.get("msg", "invalid"))
    if first.get("type") == "extra_forbidden":
        msg = "unknown field"
    if first.get("type") == "missing" and not loc:
        msg = "request body is required"
    more = f" (+{len(errs) - 1} more)" if len(errs) > 1 else ""
    return f"{loc}: {msg}{more}" if loc else f"{msg}{more}"


def install_error_map(app: FastAPI) -> None:
    @app.exception_handler(OrchestratorError)
    async def _contract(_: Request, exc: OrchestratorError) -> JSONResponse:
        retry = {"Retry-After": str(exc.retry_after)} if exc.retry_after is not None else None
        return error(exc.status, exc.message, retry)

    @app.exception_handler(ApiError)
    async def _api(_: Request, exc: ApiError) -> JSONResponse:
        return error(exc.status, exc.message)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error(400, describe_invalid(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            return error(404, f"route not found: {request.method} {request.url.path}")
        if exc.status_code == 405:
            return error(405, f"method {request.method} not allowed on {request.url.path}")
        return error(exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def _crash(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return error(500, f"internal error: {type(exc).__name__}")
