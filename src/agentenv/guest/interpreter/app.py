"""The HTTP API on port 49999: `/execute` (NDJSON stream), `/contexts`, `/health`.

Routes and status codes follow upstream's server (e2b-dev/code-interpreter template/server);
errors are `{"code","message"}` JSON. The default python context starts in the background as soon
as the app does; `/health` answers 200 only once it is up, and requests that need a context wait
for it (with a deadline).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import shutil
import tempfile
from collections.abc import AsyncIterator
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from . import envs
from .contexts import Contexts, UnknownLanguage, normalize_language
from .kernel import Kernel, KernelGone, Settings
from .messages import Line

log = logging.getLogger(__name__)


def error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"code": status, "message": message}, status_code=status)


class NDJSONStream(Response):
    """Streams lines from an async generator; a client disconnect cancels (and closes) it.

    Starlette's StreamingResponse notices a gone client only when a write fails and leaves the
    generator to the garbage collector; here the disconnect is watched for explicitly, so the
    generator's cleanup (interrupting the kernel) runs at once.
    """

    media_type = "application/x-ndjson"

    def __init__(self, lines: AsyncIterator[Line]) -> None:
        self.status_code = 200
        self.background = None
        self.raw_headers = [(b"content-type", self.media_type.encode())]
        self._lines = lines

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        pump = asyncio.create_task(self._pump(send))

        async def watch() -> None:
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    pump.cancel()
                    return

        watcher = asyncio.create_task(watch())
        try:
            with contextlib.suppress(asyncio.CancelledError, OSError):
                await pump
        finally:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher

    async def _pump(self, send: Send) -> None:
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            async for line in self._lines:
                data = (json.dumps(line) + "\n").encode()
                await send({"type": "http.response.body", "body": data, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            aclose = getattr(self._lines, "aclose", None)
            if aclose is not None:
                await aclose()


class Server:
    """The app's state: the contexts and the startup of the default one."""

    def __init__(self, settings: Settings, default_languages: list[str]) -> None:
        self.settings = settings
        self.contexts = Contexts(settings)
        self.default_languages = default_languages
        self.ready = asyncio.Event()
        self.startup_error: str | None = None
        self._startup: asyncio.Task[None] | None = None
        self._runtime = ""

    async def start(self) -> None:
        # Kernels' connection files (ports, HMAC key) go to a private dir, removed at stop:
        # uvicorn re-raises SIGTERM after the lifespan ends, so this is the last code that runs.
        if not self.settings.runtime_dir:
            self.settings.runtime_dir = self._runtime = tempfile.mkdtemp(prefix="code-interpreter-")
        self._startup = asyncio.create_task(self._start_defaults())

    async def _start_defaults(self) -> None:
        try:
            for language in self.default_languages:
                kernel = await self.contexts.default(language)
                try:
                    await kernel.warm_up()
                except Exception:  # a cold first execution, not a broken server
                    log.exception("warm-up of the %s context failed", language)
            self.ready.set()
            log.info("default contexts up: %s", ", ".join(self.default_languages))
        except Exception as exc:
            self.startup_error = str(exc)
            log.exception("default contexts failed")

    async def stop(self) -> None:
        if self._startup is not None:
            self._startup.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._startup
        await self.contexts.close()
        if self._runtime:
            shutil.rmtree(self._runtime, ignore_errors=True)

    async def wait_ready(self) -> Response | None:
        """None once the defaults are up; an error response if they failed or take too long."""
        if self.startup_error is not None:
            return error(503, f"default contexts failed to start: {self.startup_error}")
        try:
            await asyncio.wait_for(self.ready.wait(), self.settings.start_timeout)
        except TimeoutError:
            return error(503, "default contexts are not up yet")
        return None

    # routes -------------------------------------------------------------------------------

    async def health(self, request: Request) -> Response:
        if self.ready.is_set():
            return JSONResponse("OK")
        if self.startup_error is not None:
            return error(503, f"default contexts failed to start: {self.startup_error}")
        return error(503, "default contexts are starting")

    async def execute(self, request: Request) -> Response:
        body = await _json_body(request)
        if isinstance(body, Response):
            return body
        code = body.get("code")
        context_id = body.get("context_id")
        language = body.get("language")
        if not isinstance(code, str):
            return error(400, "code must be a string")
        if context_id is not None and not isinstance(context_id, str):
            return error(400, "context_id must be a string")
        if language is not None and not isinstance(language, str):
            return error(400, "language must be a string")
        try:
            env_vars = envs.check_env_vars(body.get("env_vars"))
        except ValueError as exc:
            return error(400, str(exc))
        if context_id and language:
            return error(400, "Only one of context_id or language can be provided")
        not_ready = await self.wait_ready()
        if not_ready is not None:
            return not_ready
        kernel: Kernel | None
        if context_id:
            kernel = self.contexts.by_id.get(context_id)
            if kernel is None:
                return error(404, f"Context {context_id} not found")
        else:
            try:
                kernel = await self.contexts.default(normalize_language(language))
            except UnknownLanguage as exc:
                return error(400, str(exc))
            except KernelGone as exc:
                return error(500, str(exc))
        token = request.headers.get("x-access-token")
        return NDJSONStream(kernel.execute(code, env_vars, token))

    async def create_context(self, request: Request) -> Response:
        body = await _json_body(request)
        if isinstance(body, Response):
            return body
        language = body.get("language")
        cwd = body.get("cwd")
        if language is not None and not isinstance(language, str):
            return error(400, "language must be a string")
        if cwd is not None and not isinstance(cwd, str):
            return error(400, "cwd must be a string")
        not_ready = await self.wait_ready()
        if not_ready is not None:
            return not_ready
        try:
            kernel = await self.contexts.create(
                normalize_language(language), cwd or self.settings.default_cwd
            )
        except (UnknownLanguage, ValueError) as exc:
            return error(400, str(exc))
        except KernelGone as exc:
            return error(500, str(exc))
        return JSONResponse(kernel.describe())

    async def list_contexts(self, request: Request) -> Response:
        return JSONResponse([k.describe() for k in self.contexts.by_id.values()])

    async def remove_context(self, request: Request) -> Response:
        kernel = self._context(request)
        if kernel is None:
            return error(404, f"Context {request.path_params['context_id']} not found")
        await self.contexts.remove(kernel)
        return JSONResponse(None)

    async def restart_context(self, request: Request) -> Response:
        kernel = self._context(request)
        if kernel is None:
            return error(404, f"Context {request.path_params['context_id']} not found")
        try:
            await kernel.restart()
        except Exception as exc:
            return error(500, f"Failed to restart context {kernel.id}: {exc!r}")
        return JSONResponse(None)

    def _context(self, request: Request) -> Kernel | None:
        return self.contexts.by_id.get(request.path_params["context_id"])


async def _json_body(request: Request) -> dict[str, Any] | Response:
    try:
        body = await request.json()
    except (ValueError, UnicodeDecodeError):
        return error(400, "body is not valid JSON")
    if not isinstance(body, dict):
        return error(400, "body must be a JSON object")
    return body


def build_app(settings: Settings, default_languages: list[str]) -> Starlette:
    """The ASGI app; kernels start with it and stop when it shuts down."""
    server = Server(settings, default_languages)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await server.start()
        try:
            yield
        finally:
            await server.stop()

    routes = [
        Route("/health", server.health, methods=["GET"]),
        Route("/execute", server.execute, methods=["POST"]),
        Route("/contexts", server.create_context, methods=["POST"]),
        Route("/contexts", server.list_contexts, methods=["GET"]),
        Route("/contexts/{context_id}", server.remove_context, methods=["DELETE"]),
        Route("/contexts/{context_id}/restart", server.restart_context, methods=["POST"]),
    ]
    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.server = server
    return app
