"""The envd ASGI application: Connect services, plain HTTP routes and access control."""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import hmac
import json
import logging
import re
import time
from collections.abc import Awaitable, Callable
from datetime import datetime
from typing import Any

from connectrpc.codec import proto_binary_codec
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from . import ENVD_VERSION, files_http, guest_actions, metrics
from .errors import EnvdFault, InvalidArgument, Unauthenticated
from .filesystem_service import FilesystemService
from .gen.filesystem.filesystem_connect import FilesystemASGIApplication
from .gen.process.process_connect import ProcessASGIApplication
from .process_service import ProcessService
from .process_table import ProcessTable
from .rpc import StrictJSONCodec
from .state import EnvdState
from .users import User, lookup_user, user_from_authorization

log = logging.getLogger("agentenv.envd")

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

PROCESS_METHODS = frozenset(
    ["List", "Connect", "Start", "Update", "StreamInput", "SendInput", "SendSignal", "CloseStdin"]
)
FILESYSTEM_METHODS = frozenset(
    [
        "Stat",
        "MakeDir",
        "Move",
        "ListDir",
        "Remove",
        "WatchDir",
        "CreateWatcher",
        "GetWatcherEvents",
        "RemoveWatcher",
    ]
)
_RPC_PATH = re.compile(r"^/([A-Za-z_][\w.]*\.[A-Za-z_]\w*)/([^/]+)$")
_RFC3339 = re.compile(
    r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:\.(\d{1,9}))?(Z|[+-]\d\d:\d\d)$", re.IGNORECASE
)


def parse_timestamp(value: Any) -> int:
    """`/init` timestamp (RFC 3339 string, or Unix seconds) as Unix nanoseconds."""
    if isinstance(value, bool):
        raise InvalidArgument(f"invalid timestamp {value!r}")
    if isinstance(value, int | float):
        return int(value * 1_000_000_000)
    if isinstance(value, str):
        m = _RFC3339.match(value.strip())
        if m:
            zone = "+00:00" if m.group(3).upper() == "Z" else m.group(3)
            whole = datetime.fromisoformat(m.group(1) + zone)
            fraction = (m.group(2) or "").ljust(9, "0")
            return int(whole.timestamp()) * 1_000_000_000 + int(fraction or 0)
    raise InvalidArgument(f"invalid timestamp {value!r}: want RFC 3339")


def _signature(path: str, op: str, user: str, token: str, expiration: str | None) -> str:
    raw = f"{path}:{op}:{user}:{token}"
    if expiration:
        raw += f":{expiration}"
    digest = hashlib.sha256(raw.encode()).digest()
    return "v1_" + base64.b64encode(digest).rstrip(b"=").decode()


class Envd:
    def __init__(self, state: EnvdState) -> None:
        self.state = state
        self.table = ProcessTable()
        self.filesystem = FilesystemService(state)
        codecs = [StrictJSONCodec(), proto_binary_codec()]
        self.process_app = ProcessASGIApplication(
            ProcessService(state, self.table), codecs=codecs, read_max_bytes=16 * 1024 * 1024
        )
        self.filesystem_app = FilesystemASGIApplication(self.filesystem, codecs=codecs)
        self.http = Starlette(
            routes=[
                Route("/health", self.health, methods=["GET", "HEAD"]),
                Route("/init", self.init, methods=["POST"]),
                Route("/envs", self.envs, methods=["GET"]),
                Route("/metrics", self.metrics, methods=["GET"]),
                Route("/files", self.files, methods=["GET", "POST"]),
            ],
        )
        self.http.add_exception_handler(404, self._not_found)
        self.http.add_exception_handler(405, self._not_allowed)

    # ASGI entry -------------------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        path = scope["path"]
        if path.startswith("//"):
            # A trailing slash in E2B_SANDBOX_URL makes the SDK's Connect client ask for
            # `//process.Process/Start`.
            path = "/" + path.lstrip("/")
            scope = dict(scope, path=path, raw_path=path.encode())
        match = _RPC_PATH.match(path)
        if match is None:
            await self.http(scope, receive, send)  # type: ignore[arg-type]
            return
        service, method = match.groups()
        if service == "process.Process" and method in PROCESS_METHODS:
            app: Any = self.process_app
        elif service == "filesystem.Filesystem" and method in FILESYSTEM_METHODS:
            app = self.filesystem_app
        else:
            await _connect_error(send, 404, "unimplemented", f"unknown method {path}")
            return
        token = _header(scope, b"x-access-token")
        if not self.state.token_ok(token):
            await _connect_error(send, 401, "unauthenticated", "missing or invalid access token")
            return
        await app(scope, receive, send)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                _use_pidfd_watcher()
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.table.shutdown()
                self.filesystem.close()
                await send({"type": "lifespan.shutdown.complete"})
                return

    # Plain HTTP -------------------------------------------------------------------------------

    async def _not_found(self, request: Request, exc: Exception) -> Response:
        return JSONResponse({"code": 404, "message": f"no route {request.url.path}"}, 404)

    async def _not_allowed(self, request: Request, exc: Exception) -> Response:
        return JSONResponse({"code": 405, "message": f"{request.method} not allowed"}, 405)

    def _require_token(self, request: Request) -> None:
        if not self.state.token_ok(request.headers.get("x-access-token")):
            raise Unauthenticated("missing or invalid access token")

    def _http_user(self, request: Request) -> User:
        name = request.query_params.get("username") or user_from_authorization(
            request.headers.get("authorization")
        )
        return lookup_user(name or self.state.default_user)

    async def health(self, request: Request) -> Response:
        return Response(status_code=204, headers={"x-envd-version": ENVD_VERSION})

    async def envs(self, request: Request) -> Response:
        return await _guarded(self._envs, request)

    async def _envs(self, request: Request) -> Response:
        self._require_token(request)
        return JSONResponse(self.state.env_vars)

    async def metrics(self, request: Request) -> Response:
        return await _guarded(self._metrics, request)

    async def _metrics(self, request: Request) -> Response:
        self._require_token(request)
        return JSONResponse(await metrics.collect())

    async def init(self, request: Request) -> Response:
        return await _guarded(self._init, request)

    async def _init(self, request: Request) -> Response:
        self._require_token(request)
        try:
            body = json.loads(await request.body() or b"{}")
        except ValueError as exc:
            raise InvalidArgument(f"invalid JSON body: {exc}") from None
        if not isinstance(body, dict):
            raise InvalidArgument("the /init body must be a JSON object")
        env_vars = body.get("envVars") or {}
        if not isinstance(env_vars, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in env_vars.items()
        ):
            raise InvalidArgument("envVars must map strings to strings")
        default_user = body.get("defaultUser")
        if default_user:
            lookup_user(str(default_user))
        timestamp_ns = parse_timestamp(body["timestamp"]) if body.get("timestamp") else None
        entropy = b""
        if body.get("entropy"):
            try:
                entropy = base64.b64decode(str(body["entropy"]), validate=True)
            except binascii.Error:
                raise InvalidArgument("entropy must be base64") from None
        hostname = body.get("hostname")
        # Validated everything; now apply.
        self.state.env_vars.update(env_vars)
        if "accessToken" in body:
            self.state.access_token = body["accessToken"] or None
        if default_user:
            self.state.default_user = str(default_user)
        if body.get("defaultWorkdir"):
            self.state.default_workdir = str(body["defaultWorkdir"])
        if self.state.guest:
            if timestamp_ns is not None and abs(timestamp_ns - time.time_ns()) > 50_000_000:
                guest_actions.set_clock(timestamp_ns)
            if entropy:
                guest_actions.add_entropy(entropy)
            if hostname:
                guest_actions.set_hostname(str(hostname))
        return Response(status_code=204)

    async def files(self, request: Request) -> Response:
        return await _guarded(self._files, request)

    async def _files(self, request: Request) -> Response:
        self._check_files_auth(request)
        user = self._http_user(request)
        if request.method == "GET":
            return await files_http.download(request, user, self.state.default_workdir)
        return await files_http.upload(request, user, self.state.default_workdir)

    def _check_files_auth(self, request: Request) -> None:
        """Upstream envd's order and messages (`validateSigning`, packages/envd/internal/api/
        auth.go): a token in the header decides alone; else the signature must be there and
        match; only a matching one is then checked for expiry."""
        if not self.state.access_token:
            return
        given = request.headers.get("x-access-token")
        if given:
            if self.state.token_ok(given):
                return
            raise Unauthenticated("access token present in header but does not match")
        signature = request.query_params.get("signature")
        if signature is None:
            raise Unauthenticated("missing signature query parameter")
        expiration = request.query_params.get("signature_expiration")
        expires_at = None
        if expiration is not None:
            try:
                expires_at = int(expiration)
            except ValueError:
                # Upstream's parameter binding refuses it with a 400 before any auth check.
                raise InvalidArgument(
                    f"Invalid format for parameter signature_expiration: {expiration!r}"
                ) from None
        op = "read" if request.method == "GET" else "write"
        expected = _signature(
            request.query_params.get("path", ""),
            op,
            request.query_params.get("username", ""),
            self.state.access_token,
            # As upstream, the number as it parsed (a leading zero or sign is not hashed).
            str(expires_at) if expires_at is not None else None,
        )
        if not hmac.compare_digest(expected.encode(), signature.encode()):
            raise Unauthenticated("invalid signature")
        if expires_at is not None and expires_at < time.time():
            raise Unauthenticated("signature is already expired")


async def _guarded(handler: Callable[[Request], Awaitable[Response]], request: Request) -> Response:
    try:
        return await handler(request)
    except EnvdFault as exc:
        return files_http.error_response(exc)
    except FileNotFoundError as exc:
        return JSONResponse({"code": 404, "message": f"path not found: {exc.filename}"}, 404)
    except PermissionError as exc:
        return JSONResponse({"code": 403, "message": f"permission denied: {exc.filename}"}, 403)
    except OSError as exc:
        log.warning("%s %s failed: %s", request.method, request.url.path, exc)
        return JSONResponse({"code": 500, "message": str(exc)}, 500)


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return bytes(value).decode("latin-1")
    return None


async def _connect_error(send: Send, status: int, code: str, message: str) -> None:
    body = json.dumps({"code": code, "message": message}).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


def _use_pidfd_watcher() -> None:
    # envd is not PID 1 (the guest init reaps orphans), so it waits only for its own children,
    # through pidfds instead of a thread per child.
    try:
        watcher = asyncio.PidfdChildWatcher()
        watcher.attach_loop(asyncio.get_running_loop())
        asyncio.set_child_watcher(watcher)
    except (OSError, AttributeError) as exc:
        log.info("pidfd child watcher unavailable (%s); using the default", exc)
