"""The one ASGI app on the server's port: control plane and data-plane proxy side by side."""

from __future__ import annotations

import logging
import math
import time
from typing import Any

from agentenv.api.context import ControlContext
from agentenv.api.control import build_control_app
from agentenv.api.keys import KeyRing
from agentenv.contract.runtime import TemplateSource
from agentenv.control.sandboxes import SandboxManager
from agentenv.control.store import LIVE_STATES, SandboxRecord, SandboxState
from agentenv.gateway.client import GatewayDialer
from agentenv.ports import ENVD_PORT
from agentenv.proxy.forward import SandboxProxy
from agentenv.proxy.routing import (
    FILES_PATH,
    BadRoute,
    Control,
    Sandbox,
    SignedFiles,
    normalise_path,
    route,
)
from agentenv.proxy.signed import SignedUrls
from agentenv.proxy.wire import Receive, Scope, Send, send_json

log = logging.getLogger("agentenv.api")


class AgentenvApp:
    """Routes each request (see ``proxy.routing``) and owns start-up and shutdown."""

    def __init__(
        self,
        manager: SandboxManager,
        keys: KeyRing,
        templates: TemplateSource,
        *,
        domain: str | None = None,
        dialer: GatewayDialer | None = None,
    ) -> None:
        """`dialer`: a cluster replica's, for sandboxes on nodes with a data gateway."""
        self.manager = manager
        self.keys = keys
        self.domain = domain
        self.control = build_control_app(ControlContext(manager, keys, templates, domain))
        self.proxy = SandboxProxy(
            self._resolve,
            manager.metrics,
            manager.note_activity,
            gateway_of=manager.runtime.gateway,
            dialer=dialer,
        )
        # Counts the `/metrics` route refreshed from the store just before the scrape.
        manager.metrics.watch_states(lambda: manager.state_counts_seen, lambda: manager.builds_seen)
        # Pooled connections to a killed or paused sandbox's VM are dead: never reuse them.
        manager.on_release.append(self.proxy.drop)
        # A keepalive counts an open stream (a long command) as its client being there.
        manager.open_requests = self.proxy.open_requests
        manager.metrics.watch_host_memory(lambda: manager.host_memory_seen)
        self.signed = SignedUrls(manager.store.envd_tokens, self._envd_token)
        self._started = False

    async def _envd_token(self, sandbox_id: str) -> str | None:
        # The same candidates as `Store.envd_tokens`: a gone sandbox signs nothing.
        rec = await self.manager.store.get(sandbox_id)
        return rec.envd_token if rec is not None and rec.state in LIVE_STATES else None

    async def startup(self) -> None:
        if not self._started:
            await self.manager.store.open()
            await self.manager.start()
            await self.control.state.builds.start()
            self._started = True

    async def shutdown(self) -> None:
        if self._started:
            self._started = False
            await self.proxy.close()
            # Builds first: each kills its build sandbox while the manager still runs.
            await self.control.state.builds.close()
            await self.manager.close()
            # Last: the manager's shutdown still writes rows (an etcd store's channels close).
            await self.manager.store.close()

    async def _resolve(self, sandbox_id: str) -> SandboxRecord | None:
        # A running row as this replica knows it is enough to forward on: had another
        # replica just paused or killed it, the forward fails as it would have a moment
        # earlier. Any other state is read from the store, as it decides what comes next.
        rec = self.manager.store.recent(sandbox_id)
        if rec is None or rec.state is not SandboxState.RUNNING:
            rec = await self.manager.store.get(sandbox_id)
        if rec is None:
            return None
        # Traffic never resumes a filesystem-only pause (E2B): it would reboot the guest.
        if rec.state is SandboxState.PAUSED and rec.pause_mode != "filesystem":
            # A sandbox in the grace after its timeout is there for a late scorer's reads:
            # they resume it, whatever its auto-resume, until its grace would have ended.
            grace = rec.grace_left(time.time())
            if not (rec.auto_resume or grace):
                return rec
            seconds = None if rec.auto_resume else max(1, math.ceil(grace))
            try:
                rec, _ = await self.manager.connect(sandbox_id, seconds)
            except Exception as exc:
                log.warning("sandbox %s auto-resume failed: %r", sandbox_id, exc)
                return None
        # A sandbox that is not running comes back as is so the proxy can say why it refuses.
        return rec

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "lifespan":
            await self._lifespan(receive, send)
            return
        if kind not in ("http", "websocket"):
            return
        path = normalise_path(scope["path"])
        if path != scope["path"]:
            scope = dict(scope)
            scope["path"] = path
            scope["raw_path"] = path.encode()
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        method = scope.get("method", "GET")
        query = scope.get("query_string", b"").decode("latin-1")
        target = route(method, path, headers, domain=self.domain, signed="signature=" in query)
        if isinstance(target, SignedFiles):
            found = await self.signed.find(method, query)
            target = (
                Sandbox(found, ENVD_PORT, FILES_PATH)
                if found is not None
                else BadRoute(
                    401,
                    "invalid signature: no sandbox on this server signed this URL "
                    "(the sandbox may be gone)",
                )
            )
        if isinstance(target, Control):
            if kind == "websocket":
                await send({"type": "websocket.close", "code": 1008})
                return
            await self._control(scope, receive, send)
        elif isinstance(target, BadRoute):
            if kind == "websocket":
                await send({"type": "websocket.close", "code": 1008})
                return
            await send_json(send, target.status, {"code": target.status, "message": target.message})
        elif kind == "websocket":
            await self.proxy.websocket(scope, receive, send, target)
        else:
            await self.proxy.http(scope, receive, send, target, headers)

    async def _control(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = time.monotonic()
        status = 0

        async def send_and_record(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.control(scope, receive, send_and_record)  # type: ignore[arg-type]
        finally:
            ms = (time.monotonic() - started) * 1000
            log.info(
                "%s %s -> %d in %.1f ms",
                scope.get("method"),
                scope["path"],
                status,
                ms,
                extra={"status": status, "duration_ms": round(ms, 1)},
            )

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    await self.startup()
                except Exception as exc:
                    log.exception("startup failed")
                    await send({"type": "lifespan.startup.failed", "message": str(exc)})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                try:
                    await self.shutdown()
                finally:
                    await send({"type": "lifespan.shutdown.complete"})
                return
