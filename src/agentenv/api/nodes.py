"""`/nodes`: the nodes that run this server's sandboxes, with capacity and counts, and cordons.

Not an E2B route (E2B has no public node API): `aenv node ls|cordon|uncordon` use it. Any key
may read; changing a node is for keys of the server's own team (`DEFAULT_TEAM`), since a node
serves every team.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import asdict
from typing import Annotated, Any

from fastapi import Body, Depends, FastAPI
from fastapi.responses import JSONResponse

from agentenv.contract.nodes import NodeDirectory, NodeStatus, UnknownNode
from agentenv.control.store import DEFAULT_TEAM, ApiKey


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
    }


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"code": status, "message": message}, status_code=status)


def mount_nodes(
    app: FastAPI,
    nodes: NodeDirectory,
    api_key: Callable[..., Awaitable[ApiKey]],
    pause: Callable[[str], Awaitable[str | None]] | None = None,
) -> None:
    """`pause(sandbox_id)` pauses one running sandbox through the state machine and says
    what it did ("paused", or None if it was not running); `drain` needs it."""
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
            return _error(404, str(exc))

    async def _set(node_id: str, key: ApiKey, cordoned: bool, reason: str) -> JSONResponse:
        if key.team_id != DEFAULT_TEAM:
            return _error(403, "only keys of the server's own team may change a node")
        try:
            return JSONResponse(view(await nodes.cordon(node_id, cordoned=cordoned, reason=reason)))
        except UnknownNode as exc:
            return _error(404, str(exc))

    @app.post("/nodes/{node_id}/cordon", tags=["nodes"])
    async def cordon(
        node_id: str,
        body: Annotated[dict[str, Any] | None, Body()] = None,
        key: ApiKey = auth,
    ) -> JSONResponse:
        extra = sorted(set(body or {}) - {"reason"})
        if extra:
            return _error(400, f"unknown field(s): {', '.join(extra)}; only 'reason' is taken")
        reason = (body or {}).get("reason", "")
        if not isinstance(reason, str):
            return _error(400, "reason: expected a string")
        return await _set(node_id, key, True, reason)

    @app.post("/nodes/{node_id}/drain", tags=["nodes"])
    async def drain(node_id: str, key: ApiKey = auth) -> JSONResponse:
        """Cordon the node, then pause every sandbox running there (with its memory), one
        at a time: none is lost, and each resumes when asked."""
        if key.team_id != DEFAULT_TEAM:
            return _error(403, "only keys of the server's own team may change a node")
        if pause is None:
            return _error(501, "this server cannot drain nodes")
        try:
            await nodes.cordon(node_id, cordoned=True, reason="drained")
            ids = await nodes.sandboxes_on(node_id)
        except UnknownNode as exc:
            return _error(404, str(exc))
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
