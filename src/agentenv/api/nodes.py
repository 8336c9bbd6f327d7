"""`/nodes`: the nodes that run this server's sandboxes, with capacity and counts, and cordons.

Not an E2B route (E2B has no public node API): `aenv node ls|cordon|uncordon` use it. Any key
may read; changing a node is for keys of the server's own team (`DEFAULT_TEAM`), since a node
serves every team.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict
from typing import Annotated, Any

from fastapi import Body, Depends, FastAPI
from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from agentenv.api.errors import error
from agentenv.contract.nodes import NodeDirectory, NodeStatus, UnknownNode
from agentenv.control.metrics import Metrics
from agentenv.control.store import DEFAULT_TEAM, ApiKey

log = logging.getLogger(__name__)

# The node listing behind the per-node series: read at most this often (a scrape without a
# key still reaches the hook before the route refuses it), and within this long.
NODE_GAUGES_MIN_AGE_S = 1.0
NODE_GAUGES_TIMEOUT_S = 10.0


def view(st: NodeStatus) -> dict[str, Any]:
    body = asdict(st)
    return {
        "nodeID": body["node_id"],
        "state": body["state"],
        "rpcURL": body["rpc_url"],
        "version": body["version"],
        "cpuCount": body["cpus"],
        "memoryMB": body["memory_mb"],
        "slots": body["slots"],
        "freeMemoryMB": body["free_memory_mb"],
        "freeSlots": body["free_slots"],
        "running": body["running"],
        "paused": body["paused"],
        "updatedAt": body["updated_at"],
        "cordonReason": body["cordon_reason"],
        "gateway": body["gateway"],
    }


class NodeGauges:
    """The per-node Prometheus series (`Metrics.watch_nodes`): what `GET /nodes` lists, read
    again before each scrape of `/metrics` and kept in `seen` for the collector, which
    cannot await (as the route does for sandbox counts and host memory)."""

    def __init__(self, nodes: NodeDirectory, metrics: Metrics) -> None:
        self.nodes = nodes
        self.seen: list[NodeStatus] = []
        self._read_at = -NODE_GAUGES_MIN_AGE_S
        self._lock = asyncio.Lock()
        metrics.watch_nodes(lambda: self.seen)

    async def refresh(self) -> None:
        """Never raises: a listing that fails (etcd away) or is slow leaves no node series,
        rather than the last ones as if they were current."""
        async with self._lock:  # concurrent scrapes share one read
            if time.monotonic() - self._read_at < NODE_GAUGES_MIN_AGE_S:
                return
            try:
                async with asyncio.timeout(NODE_GAUGES_TIMEOUT_S):
                    self.seen = await self.nodes.nodes()
            except Exception as exc:
                log.warning("metrics: the nodes could not be listed: %s", exc)
                self.seen = []
            self._read_at = time.monotonic()


class _RefreshBeforeScrape:
    """ASGI middleware: `refresh()` before `GET <path>` goes on to the route."""

    def __init__(self, app: ASGIApp, path: str, refresh: Callable[[], Awaitable[None]]) -> None:
        self.app = app
        self.path = path
        self.refresh = refresh

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "GET" and scope["path"] == self.path:
            await self.refresh()
        await self.app(scope, receive, send)


def mount_nodes(
    app: FastAPI,
    nodes: NodeDirectory,
    api_key: Callable[..., Awaitable[ApiKey]],
    pause: Callable[[str], Awaitable[str | None]] | None = None,
    *,
    metrics: Metrics | None = None,
) -> None:
    """`pause(sandbox_id)` pauses one running sandbox through the state machine and says
    what it did ("paused", or None if it was not running); `drain` needs it. With `metrics`,
    the app's `/metrics` also carries a series per node (`NodeGauges`)."""
    if metrics is not None:
        gauges = NodeGauges(nodes, metrics)
        app.add_middleware(_RefreshBeforeScrape, path="/metrics", refresh=gauges.refresh)
    # A default, not an `Annotated` alias: this module's annotations are strings, and FastAPI
    # resolves them in module globals, where a local alias is not.
    auth = Depends(api_key)

    @app.get("/nodes", tags=["nodes"])
    async def list_nodes(key: ApiKey = auth) -> JSONResponse:
        return JSONResponse([view(st) for st in await nodes.nodes()])

    @app.get("/nodes/{node_id}", tags=["nodes"])
    async def get_node(node_id: str, key: ApiKey = auth) -> JSONResponse:
        try:
            return JSONResponse(view(await nodes.node(node_id)))
        except UnknownNode as exc:
            return error(404, str(exc))

    async def _set(node_id: str, key: ApiKey, cordoned: bool, reason: str) -> JSONResponse:
        if key.team_id != DEFAULT_TEAM:
            return error(403, "only keys of the server's own team may change a node")
        try:
            return JSONResponse(view(await nodes.cordon(node_id, cordoned=cordoned, reason=reason)))
        except UnknownNode as exc:
            return error(404, str(exc))

    @app.post("/nodes/{node_id}/cordon", tags=["nodes"])
    async def cordon(
        node_id: str,
        body: Annotated[dict[str, Any] | None, Body()] = None,
        key: ApiKey = auth,
    ) -> JSONResponse:
        extra = sorted(set(body or {}) - {"reason"})
        if extra:
            return error(400, f"unknown field(s): {', '.join(extra)}; only 'reason' is taken")
        reason = (body or {}).get("reason", "")
        if not isinstance(reason, str):
            return error(400, "reason: expected a string")
        return await _set(node_id, key, True, reason)

    @app.post("/nodes/{node_id}/drain", tags=["nodes"])
    async def drain(node_id: str, key: ApiKey = auth) -> JSONResponse:
        """Cordon the node, then pause every sandbox running there (with its memory), one
        at a time: none is lost, and each resumes when asked."""
        if key.team_id != DEFAULT_TEAM:
            return error(403, "only keys of the server's own team may change a node")
        if pause is None:
            return error(501, "this server cannot drain nodes")
        try:
            await nodes.cordon(node_id, cordoned=True, reason="drained")
            ids = await nodes.sandboxes_on(node_id)
        except UnknownNode as exc:
            return error(404, str(exc))
        paused: list[str] = []
        failed: dict[str, str] = {}
        for sandbox_id in ids:
            try:
                if await pause(sandbox_id) is not None:
                    paused.append(sandbox_id)
            except Exception as exc:
                failed[sandbox_id] = str(exc)
        body = {"node": view(await nodes.node(node_id)), "paused": paused, "failed": failed}
        return JSONResponse(body, status_code=200 if not failed else 500)

    @app.post("/nodes/{node_id}/uncordon", tags=["nodes"])
    async def uncordon(node_id: str, key: ApiKey = auth) -> JSONResponse:
        return await _set(node_id, key, False, "")
