"""The routes on existing sandboxes: list (v1, v2 keyset pages), get, kill, timeout, refresh,
pause, resume, connect, snapshots, fork, metrics, logs and the egress update. Every one checks
that the caller's team owns the sandbox first (another team's is a 404)."""

from __future__ import annotations

import time
from typing import Annotated, Any

from fastapi import FastAPI, Query, Request, Response
from fastapi.responses import JSONResponse

from agentenv.api import views
from agentenv.api.auth import ApiError, Auth
from agentenv.api.context import ControlContext
from agentenv.api.models import (
    ConnectBody,
    ForkBody,
    NetworkUpdate,
    PauseBody,
    RefreshBody,
    ResetBody,
    ResumeBody,
    SnapshotBody,
    TimeoutBody,
)
from agentenv.api.paging import (
    MAX_PAGE,
    decode_offset,
    decode_token,
    encode_offset,
    encode_token,
    parse_metadata,
    parse_states,
    parse_time,
)
from agentenv.api.sandbox_create import check_targets
from agentenv.api.template_builds import TemplateBuilds
from agentenv.build.templates import is_internal_name
from agentenv.contract.errors import Conflict, SandboxNotFound
from agentenv.control.sandbox_base import DEFAULT_TIMEOUT_S, CreateSpec
from agentenv.control.store import ApiKey, SandboxRecord, SandboxState


def mount_sandbox_routes(app: FastAPI, ctx: ControlContext, builds: TemplateBuilds) -> None:
    mgr = ctx.manager
    tenancy = builds.tenancy

    async def owned(sandbox_id: str, key: ApiKey) -> None:
        # Another team's sandbox is a 404 like one that never existed (E2B's rule).
        await tenancy.check_sandbox(sandbox_id, key.team_id)

    # -- list ------------------------------------------------------------------------------

    @app.get("/v2/sandboxes", tags=["sandboxes"])
    async def list_v2(
        request: Request,
        key: Auth,
        limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = MAX_PAGE,
        nextToken: str | None = None,
        order: str = "desc",
        startedAfter: str | None = None,
        template: str | None = None,
    ) -> JSONResponse:
        """E2B's keyset pages: by start time (microseconds), newest first unless
        ``order=asc``; ties by id (ascending when newest first, the exact reverse for asc);
        ``nextToken`` names the last row of the previous page and its order."""
        states = parse_states(request.query_params.getlist("state"))
        meta = parse_metadata(request.query_params.get("metadata"), encoded_twice=True)
        if order not in ("asc", "desc"):
            raise ApiError(400, f"order must be 'asc' or 'desc', not {order!r}")
        desc = order == "desc"
        after = parse_time(startedAfter) if startedAfter else None
        cursor = decode_token(nextToken, desc) if nextToken else None
        rows = [
            (views.micros(r.started_at), r)
            for r in await mgr.store.select(views.LISTED_STATES, team_id=key.team_id)
            if views.listed_state(r) in states
            and views.user_sandbox(r)
            and all(r.metadata.get(k) == v for k, v in meta.items())
            and (template is None or template in (r.template, r.alias))
        ]
        # At or after `startedAfter`, both on the microsecond grid the client was shown.
        rows = [(us, r) for us, r in rows if after is None or us >= after]
        rows.sort(key=lambda row: (-row[0], row[1].id))
        if not desc:
            rows.reverse()
        headers: dict[str, str] = {}
        if "running" in states:
            running = sum(1 for _, r in rows if views.listed_state(r) == "running")
            headers["x-total-running"] = str(running)
        if cursor is not None:
            cur_us, cur_id = cursor

            def past_cursor(us: int, sandbox_id: str) -> bool:
                if desc:
                    return us < cur_us or (us == cur_us and sandbox_id > cur_id)
                return us > cur_us or (us == cur_us and sandbox_id < cur_id)

            rows = [(us, r) for us, r in rows if past_cursor(us, r.id)]
        page = rows[:limit]
        if len(rows) > limit:
            last_us, last = page[-1]
            headers["x-next-token"] = encode_token(last_us, last.id, desc)
        recs = [r for _, r in page]
        mems = await mgr.host_memories(recs)
        body = [views.host_memory(views.listed(r), m) for r, m in zip(recs, mems, strict=True)]
        return JSONResponse(body, headers=headers)

    @app.get("/sandboxes", tags=["sandboxes"])
    async def list_v1(request: Request, key: Auth) -> JSONResponse:
        meta = parse_metadata(request.query_params.get("metadata"), encoded_twice=False)
        recs = [
            r
            for r in await mgr.store.select(
                [SandboxState.RUNNING, SandboxState.PAUSING], team_id=key.team_id
            )
            if views.user_sandbox(r) and all(r.metadata.get(k) == v for k, v in meta.items())
        ]
        # Newest first, as E2B's v1 list.
        recs.sort(key=lambda r: (-views.micros(r.started_at), r.id))
        mems = await mgr.host_memories(recs)
        return JSONResponse(
            [views.host_memory(views.listed(r), m) for r, m in zip(recs, mems, strict=True)]
        )

    # -- one sandbox -----------------------------------------------------------------------

    @app.get("/sandboxes/{sandbox_id}", tags=["sandboxes"])
    async def get_sandbox(sandbox_id: str, key: Auth) -> JSONResponse:
        await owned(sandbox_id, key)
        rec = await mgr.get(sandbox_id)
        if views.listed_state(rec) is None:
            raise SandboxNotFound(sandbox_id)
        mem = await mgr.host_memory(rec)
        return JSONResponse(views.host_memory(views.detail(rec, ctx.domain), mem))

    @app.delete("/sandboxes/{sandbox_id}", status_code=204, tags=["sandboxes"])
    async def kill(sandbox_id: str, key: Auth) -> Response:
        await owned(sandbox_id, key)
        await mgr.kill(sandbox_id)
        return Response(status_code=204)

    @app.post("/sandboxes/{sandbox_id}/timeout", status_code=204, tags=["sandboxes"])
    async def set_timeout(sandbox_id: str, body: TimeoutBody, key: Auth) -> Response:
        await owned(sandbox_id, key)
        await mgr.set_timeout(sandbox_id, body.timeout)
        return Response(status_code=204)

    @app.post("/sandboxes/{sandbox_id}/refreshes", status_code=204, tags=["sandboxes"])
    async def refresh(sandbox_id: str, key: Auth, body: RefreshBody | None = None) -> Response:
        await owned(sandbox_id, key)
        duration = body.duration if body and body.duration is not None else 60
        await mgr.refresh(sandbox_id, duration)
        return Response(status_code=204)

    @app.post("/sandboxes/{sandbox_id}/pause", status_code=204, tags=["sandboxes"])
    async def pause(sandbox_id: str, key: Auth, body: PauseBody | None = None) -> Response:
        await owned(sandbox_id, key)
        body = body or PauseBody()
        await mgr.pause(
            sandbox_id,
            require_healthy_guest=body.requireHealthyGuest is True,
            memory=body.memory is not False,
        )
        return Response(status_code=204)

    @app.post("/sandboxes/{sandbox_id}/resume", status_code=201, tags=["sandboxes"])
    async def resume(sandbox_id: str, key: Auth, body: ResumeBody | None = None) -> JSONResponse:
        await owned(sandbox_id, key)
        body = body or ResumeBody()
        rec = await mgr.resume(
            sandbox_id, body.timeout, auto_pause=body.autoPause, memory=body.memory
        )
        return JSONResponse(views.sandbox(rec, ctx.domain), status_code=201)

    async def connect(sandbox_id: str, body: ConnectBody | None) -> JSONResponse:
        body = body or ConnectBody()
        try:
            rec, resumed = await mgr.connect(sandbox_id, body.timeout, memory=body.memory)
        except Conflict as exc:
            raise ApiError(409, exc.message) from exc
        return JSONResponse(views.sandbox(rec, ctx.domain), status_code=201 if resumed else 200)

    @app.post("/sandboxes/{sandbox_id}/snapshots", status_code=201, tags=["snapshots"])
    async def create_snapshot(
        sandbox_id: str, key: Auth, body: SnapshotBody | None = None
    ) -> JSONResponse:
        body = body or SnapshotBody()
        if body.name is not None and is_internal_name(body.name):
            raise ApiError(400, f"name {body.name!r}: build-cache-* and build-final-* are reserved")
        if body.name is not None and await builds.state.template(body.name) is not None:
            raise ApiError(409, f"name {body.name!r} is a built template's")
        await owned(sandbox_id, key)
        if body.name is not None and await tenancy.name_taken(body.name, key.team_id):
            # Names are one name space per server; moving it would take another team's.
            raise ApiError(409, f"name {body.name!r} is taken")
        info = await mgr.snapshot(sandbox_id, body.name, memory=body.memory is not False)
        await mgr.store.set_snapshot_owner(info.snapshot_id, key.team_id)
        return JSONResponse({"snapshotID": info.snapshot_id, "names": info.names}, 201)

    @app.post("/snapshots/{snapshot_id}/fork", status_code=201, tags=["snapshots"])
    async def fork_snapshot(
        snapshot_id: str, key: Auth, body: ForkBody | None = None
    ) -> JSONResponse:
        """`count` new sandboxes from a persistent snapshot of this team (by id or name), all
        or none, as a running sandbox's fork answers: each maps the snapshot's memory file
        copy-on-write and is reseeded (RNG, identity) like any create from it."""
        body = body or ForkBody()
        found = [
            s
            for s in await mgr.snapshots()
            if snapshot_id in (s.snapshot_id, *s.names)
            and not (s.names and all(map(is_internal_name, s.names)))
        ]
        if not found or await mgr.store.snapshot_owner(found[0].snapshot_id) != key.team_id:
            raise ApiError(404, f"snapshot {snapshot_id!r} not found")
        spec = CreateSpec(template=found[0].snapshot_id, timeout=body.timeout or DEFAULT_TIMEOUT_S)
        children = await mgr.create_many(spec, body.count, key.id, key.team_id)
        return JSONResponse([{"sandbox": views.sandbox(c, ctx.domain)} for c in children], 201)

    @app.get("/snapshots", tags=["snapshots"])
    async def list_snapshots(
        key: Auth,
        sandboxID: str | None = None,
        name: str | None = None,
        limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = MAX_PAGE,
        nextToken: str | None = None,
    ) -> JSONResponse:
        # A snapshot's source is the sandbox's id (the node runs it under the API's id).
        rows = [
            s
            for s in sorted(await mgr.snapshots(), key=lambda s: (s.created_at, s.snapshot_id))
            if not (s.names and all(map(is_internal_name, s.names)))
            and await mgr.store.snapshot_owner(s.snapshot_id) == key.team_id
            and (sandboxID is None or s.source == sandboxID)
            and (name is None or name in s.names or name == s.snapshot_id)
        ]
        start = decode_offset(nextToken) if nextToken else 0
        page = rows[start : start + limit]
        more = start + limit < len(rows)
        headers = {"x-next-token": encode_offset(start + limit)} if more else {}
        body = [{"snapshotID": s.snapshot_id, "names": s.names} for s in page]
        return JSONResponse(body, headers=headers)

    @app.post("/sandboxes/{sandbox_id}/fork", status_code=201, tags=["sandboxes"])
    async def fork(sandbox_id: str, key: Auth, body: ForkBody | None = None) -> JSONResponse:
        """`count` new running sandboxes from one capture of this one, all or none, within
        the team's limits: each has its files, processes and memory (mapped copy-on-write)
        and is reseeded (RNG, identity). A running sandbox keeps running; a paused one stays
        paused as it was and may be resumed later (409 if its pause kept no memory)."""
        await owned(sandbox_id, key)
        body = body or ForkBody()
        children = await mgr.fork(sandbox_id, body.count, body.timeout, key.id)
        return JSONResponse([{"sandbox": views.sandbox(c, ctx.domain)} for c in children], 201)

    @app.post("/sandboxes/{sandbox_id}/reset", tags=["sandboxes"])
    async def reset(sandbox_id: str, key: Auth, body: ResetBody | None = None) -> JSONResponse:
        """Put a running sandbox back to the state it was created from (or to a snapshot of
        this team), keeping its id, URL, tokens, metadata and timeout."""
        await owned(sandbox_id, key)
        body = body or ResetBody()
        if body.snapshot is not None:
            found = [s for s in await mgr.snapshots() if body.snapshot in (s.snapshot_id, *s.names)]
            if not found or await mgr.store.snapshot_owner(found[0].snapshot_id) != key.team_id:
                raise ApiError(404, f"snapshot {body.snapshot!r} not found")
        rec = await mgr.reset(sandbox_id, body.snapshot)
        return JSONResponse(views.sandbox(rec, ctx.domain))

    @app.post("/sandboxes/{sandbox_id}/connect", tags=["sandboxes"])
    async def connect_v1(
        sandbox_id: str, key: Auth, body: ConnectBody | None = None
    ) -> JSONResponse:
        await owned(sandbox_id, key)
        return await connect(sandbox_id, body)

    @app.post("/v2/sandboxes/{sandbox_id}/connect", tags=["sandboxes"])
    async def connect_v2(
        sandbox_id: str, key: Auth, body: ConnectBody | None = None
    ) -> JSONResponse:
        await owned(sandbox_id, key)
        return await connect(sandbox_id, body)

    @app.get("/sandboxes/{sandbox_id}/metrics", tags=["sandboxes"])
    async def sandbox_metrics(
        sandbox_id: str,
        key: Auth,
        start: Annotated[int | None, Query(ge=0)] = None,
        end: Annotated[int | None, Query(ge=0)] = None,
    ) -> JSONResponse:
        """The samples in [start, end] (Unix seconds, both optional, as E2B). No history is
        kept here: the one sample is the guest's current one, returned when it falls in the
        range."""
        if start is not None and end is not None and start > end:
            raise ApiError(400, f"Invalid time range for metrics: start {start} is after end {end}")
        await owned(sandbox_id, key)
        rec = await mgr.get(sandbox_id)
        raw = await mgr.guest_metrics(rec)
        if not raw:
            return JSONResponse([])
        sample = metric_sample(rec, raw)
        at = int(sample["timestampUnix"])
        if (start is not None and at < start) or (end is not None and at > end):
            return JSONResponse([])
        return JSONResponse([views.host_memory(sample, await mgr.host_memory(rec))])

    @app.get("/sandboxes/{sandbox_id}/logs", tags=["sandboxes"])
    async def logs_v1(
        sandbox_id: str,
        key: Auth,
        start: Annotated[int, Query(ge=0)] = 0,
        limit: Annotated[int, Query(ge=1, le=10000)] = 1000,
    ) -> JSONResponse:
        # Logs stay readable after a kill; an id the team never had is a 404.
        await owned(sandbox_id, key)
        lines = await mgr.store.logs(sandbox_id, start=start / 1000, limit=limit)
        return JSONResponse(views.logs_v1(lines))

    @app.get("/v2/sandboxes/{sandbox_id}/logs", tags=["sandboxes"])
    async def logs_v2(
        sandbox_id: str,
        key: Auth,
        cursor: Annotated[int, Query(ge=0)] = 0,
        limit: Annotated[int, Query(ge=1, le=10000)] = 1000,
    ) -> JSONResponse:
        # Logs stay readable after a kill; an id the team never had is a 404.
        await owned(sandbox_id, key)
        lines = await mgr.store.logs(sandbox_id, start=cursor / 1000, limit=limit)
        return JSONResponse(views.logs_v2(lines))

    @app.put("/sandboxes/{sandbox_id}/network", status_code=204, tags=["sandboxes"])
    async def update_network(sandbox_id: str, key: Auth, body: NetworkUpdate) -> Response:
        await owned(sandbox_id, key)
        # E2B replaces the whole egress config: what the body leaves out is cleared.
        named = [k for k in ("egressProxy", "rules") if getattr(body, k) is not None]
        if named:
            raise ApiError(400, f"{', '.join(named)}: not enforced by this server yet")
        check_targets("", body.allowOut, body.denyOut, body.dnsServers)
        allow_internet = True if body.allowInternetAccess is None else body.allowInternetAccess
        await mgr.update_network(
            sandbox_id,
            allow_internet,
            list(body.allowOut or []),
            list(body.denyOut or []),
            None if body.dnsServers is None else list(body.dnsServers),
        )
        return Response(status_code=204)


def metric_sample(rec: SandboxRecord, m: dict[str, Any]) -> dict[str, Any]:
    """envd's `/metrics` numbers in the SDK's SandboxMetric shape (every field required)."""
    ts = float(m.get("ts", time.time()))
    return {
        "timestamp": views.iso(ts),
        "timestampUnix": int(ts),
        "cpuCount": int(m.get("cpu_count", rec.cpu)),
        "cpuUsedPct": float(m.get("cpu_used_pct", 0.0)),
        "memUsed": int(m.get("mem_used", 0)),
        "memTotal": int(m.get("mem_total", 0)),
        "memCache": int(m.get("mem_cache", 0)),
        "diskUsed": int(m.get("disk_used", 0)),
        "diskTotal": int(m.get("disk_total", 0)),
    }
