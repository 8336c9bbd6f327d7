"""The E2B-compatible control plane (v1 and v2 routes) as a FastAPI app.

Every error leaves through `api.errors` (the one error map): ``{"code": int, "message": str}``.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import logging
import time
from dataclasses import dataclass, field
from datetime import datetime
from typing import Annotated, Any
from urllib.parse import parse_qsl, unquote

from fastapi import FastAPI, Header, Query, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from agentenv.api import views
from agentenv.api.auth import ApiError, Auth
from agentenv.api.build_progress import mount_build_progress
from agentenv.api.errors import error, install_error_map
from agentenv.api.ingress import BadIngress, check_ingress
from agentenv.api.keys import KeyRing
from agentenv.api.models import (
    ConnectBody,
    ForkBody,
    NetworkUpdate,
    NewSandbox,
    PauseBody,
    RefreshBody,
    ResumeBody,
    SnapshotBody,
    TimeoutBody,
)
from agentenv.api.templates import mount_templates
from agentenv.api.tenancy import template_team
from agentenv.build.state import TemplateRecord
from agentenv.build.templates import is_internal_name, split_name
from agentenv.contract.errors import (
    BadRequest,
    Conflict,
    SandboxNotFound,
    TemplateNotFound,
)
from agentenv.contract.runtime import TemplateInfo, TemplateSource, TemplateUnavailable
from agentenv.control.sandboxes import DEFAULT_TIMEOUT_S, CreateSpec, SandboxManager
from agentenv.control.store import (
    BUILD_METADATA,
    DEFAULT_TEAM,
    LIVE_STATES,
    ApiKey,
    SandboxRecord,
    SandboxState,
)
from agentenv.network.egress import BadTarget, Egress

log = logging.getLogger("agentenv.api")

MAX_PAGE = 100
IDEMPOTENCY_TTL_S = 24 * 3600


@dataclass
class ControlContext:
    manager: SandboxManager
    keys: KeyRing
    templates: TemplateSource
    domain: str | None = None
    _idem_locks: dict[tuple[str, str], asyncio.Lock] = field(default_factory=dict)


def build_control_app(ctx: ControlContext) -> FastAPI:
    app = FastAPI(
        title="agentenv",
        version="0.1.0",
        description="E2B-compatible control plane for microVM sandboxes",
        openapi_url="/openapi.json",
        docs_url="/docs",
        redoc_url=None,
    )
    app.state.ctx = ctx
    mgr = ctx.manager
    # First, so `DELETE /templates/tags` is not taken for a template id.
    builds = mount_templates(app, ctx)
    mount_build_progress(app, builds)
    built = builds.built
    tenancy = builds.tenancy

    async def owned(sandbox_id: str, key: ApiKey) -> None:
        # Another team's sandbox is a 404 like one that never existed (E2B's rule).
        await tenancy.check_sandbox(sandbox_id, key.team_id)

    install_error_map(app)

    # -- server endpoints ------------------------------------------------------------------

    @app.get("/health", tags=["server"])
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/metrics", tags=["server"], response_class=Response)
    async def metrics(key: Auth) -> Response:
        # Per-sandbox series only for the caller's team; node-wide ones for every key.
        await mgr.host_memory_all()
        await mgr.state_counts()
        text = generate_latest(mgr.metrics.registry).decode()
        return Response(
            await tenancy.filter_metrics(text, key.team_id), media_type=CONTENT_TYPE_LATEST
        )

    # -- create ----------------------------------------------------------------------------

    async def create(
        body: NewSandbox, key: ApiKey, idem_key: str | None, *, v2: bool
    ) -> JSONResponse:
        if body.volumeMounts:
            raise ApiError(400, "volumeMounts are not supported by this server")
        if body.mcp is not None:
            raise ApiError(400, "mcp sandboxes are not supported by this server")
        if (
            body.autoPauseMemory is False
            and body.autoResume is not None
            and body.autoResume.enabled
        ):
            # As E2B: traffic never resumes a filesystem-only pause (it would reboot the guest).
            raise ApiError(
                400,
                "autoResume.enabled: true cannot be combined with autoPauseMemory: false; a "
                "sandbox paused without memory is resumed only by connect",
            )
        network = body.network.model_dump(exclude_none=True) if body.network else {}
        _refuse_unenforced(body, network)
        if BUILD_METADATA in body.metadata:
            raise ApiError(400, f"metadata.{BUILD_METADATA}: reserved for template builds")
        if await built.internal(body.templateID) or not await tenancy.template_visible(
            body.templateID, key.team_id
        ):
            raise TemplateNotFound(body.templateID)
        spec = CreateSpec(
            template=body.templateID,
            timeout=body.timeout or DEFAULT_TIMEOUT_S,
            auto_pause=body.autoPause,
            auto_pause_memory=body.autoPauseMemory is not False,
            auto_resume=body.autoResume.enabled if body.autoResume is not None else None,
            # v2 is always secured; v1 asks with `secure`.
            secure=True if v2 else body.secure,
            allow_internet=body.allow_internet_access,
            metadata=body.metadata,
            env_vars=body.envVars,
            network=network,
            cpu=body.cpuCount,
            memory_mb=body.memoryMB,
            disk_mb=body.diskSizeMB,
        )
        if not idem_key:
            rec = await mgr.create(spec, key.id, key.team_id)
            return JSONResponse(views.sandbox(rec, ctx.domain), status_code=201)
        if len(idem_key) > 256:
            raise ApiError(400, "Idempotency-Key is longer than 256 characters")
        digest = hashlib.sha256(json.dumps(body.model_dump(), sort_keys=True).encode()).hexdigest()
        store = mgr.store
        slot = (key.id, idem_key)
        lock = ctx._idem_locks.setdefault(slot, asyncio.Lock())
        try:
            async with lock:
                await store.expire_idempotency(time.time() - IDEMPOTENCY_TTL_S)
                # The claim is the atomic step; the lock only spares waiters a 409.
                if not await store.claim_idempotency(key.id, idem_key, digest):
                    seen = await store.idempotency(key.id, idem_key)
                    if seen is None or seen[0] != digest:
                        raise ApiError(409, "Idempotency-Key was already used with another body")
                    prior = await store.get(seen[1]) if seen[1] else None
                    if prior is None:
                        raise ApiError(409, "Idempotency-Key belongs to a create in progress")
                    return JSONResponse(views.sandbox(prior, ctx.domain), status_code=201)
                try:
                    rec = await mgr.create(spec, key.id, key.team_id)
                except BaseException:
                    await store.release_idempotency(key.id, idem_key)
                    raise
                await store.complete_idempotency(key.id, idem_key, rec.id)
        finally:
            if not lock.locked():
                ctx._idem_locks.pop(slot, None)
        return JSONResponse(views.sandbox(rec, ctx.domain), status_code=201)

    @app.post("/v2/sandboxes", status_code=201, tags=["sandboxes"])
    async def create_v2(
        body: NewSandbox,
        key: Auth,
        idempotency_key: Annotated[str | None, Header()] = None,
    ) -> JSONResponse:
        return await create(body, key, idempotency_key, v2=True)

    @app.post("/sandboxes", status_code=201, tags=["sandboxes"])
    async def create_v1(
        body: NewSandbox,
        key: Auth,
        idempotency_key: Annotated[str | None, Header()] = None,
    ) -> JSONResponse:
        return await create(body, key, idempotency_key, v2=False)

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
        states = _parse_states(request.query_params.getlist("state"))
        meta = _parse_metadata(request.query_params.get("metadata"), encoded_twice=True)
        if order not in ("asc", "desc"):
            raise ApiError(400, f"order must be 'asc' or 'desc', not {order!r}")
        desc = order == "desc"
        after = _parse_time(startedAfter) if startedAfter else None
        cursor = _decode_token(nextToken, desc) if nextToken else None
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
            headers["x-next-token"] = _encode_token(last_us, last.id, desc)
        recs = [r for _, r in page]
        mems = await mgr.host_memories(recs)
        body = [views.host_memory(views.listed(r), m) for r, m in zip(recs, mems, strict=True)]
        return JSONResponse(body, headers=headers)

    @app.get("/sandboxes", tags=["sandboxes"])
    async def list_v1(request: Request, key: Auth) -> JSONResponse:
        meta = _parse_metadata(request.query_params.get("metadata"), encoded_twice=False)
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
        start = _decode_offset(nextToken) if nextToken else 0
        page = rows[start : start + limit]
        more = start + limit < len(rows)
        headers = {"x-next-token": _encode_offset(start + limit)} if more else {}
        body = [{"snapshotID": s.snapshot_id, "names": s.names} for s in page]
        return JSONResponse(body, headers=headers)

    @app.post("/sandboxes/{sandbox_id}/fork", status_code=201, tags=["sandboxes"])
    async def fork(sandbox_id: str, key: Auth, body: ForkBody | None = None) -> JSONResponse:
        await owned(sandbox_id, key)
        body = body or ForkBody()
        children = await mgr.fork(sandbox_id, body.count, body.timeout, key.id)
        return JSONResponse([{"sandbox": views.sandbox(c, ctx.domain)} for c in children], 201)

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
        sample = _metric_sample(rec, raw)
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

    # -- templates -------------------------------------------------------------------------

    @app.get("/templates", tags=["templates"])
    async def list_templates(key: Auth, teamID: str | None = None) -> JSONResponse:
        if teamID is not None and teamID != key.team_id:
            raise ApiError(400, "Team ID param mismatch with the API key")
        spawns = await mgr.store.spawns(key.team_id)
        rows = [
            views.template(t, mgr.envd_version, spawns.get(t.name))
            for t in await ctx.templates.list()
            if await tenancy.catalog_visible(t.name, key.team_id)
        ]
        made = sorted(
            (t for t in await builds.state.templates() if template_team(t) == key.team_id),
            key=lambda t: t.created_at,
        )
        rows += [await builds.template_view(t, spawns) for t in made]
        return JSONResponse(rows)

    async def visible(ref: str, key: ApiKey) -> TemplateInfo:
        """A template the caller may see (not one of the builder's snapshots, not another
        team's snapshot)."""
        if await built.internal(ref) or not await tenancy.template_visible(ref, key.team_id):
            raise TemplateUnavailable(ref)
        return await built.get(ref)

    async def own_template(name: str, key: ApiKey) -> TemplateRecord | None:
        """The caller's built template of that name (another team's is None: a 404)."""
        tpl = await builds.state.template(name)
        return tpl if tpl is not None and template_team(tpl) == key.team_id else None

    @app.get("/templates/aliases/{alias:path}", tags=["templates"])
    async def template_alias(alias: str, key: Auth) -> JSONResponse:
        """E2B's alias check (`Template.exists`): 200 `TemplateAliasResponse` or 404. A
        built template's name exists from its first build request on; `name:tag` only
        while the tag names a ready build."""
        name, tag = split_name(alias)
        tpl = await own_template(name, key)
        if tpl is None and await builds.state.template(name) is not None:
            raise ApiError(404, f"template '{alias}' not found")
        if tpl is not None:
            if ":" in alias:
                try:
                    await built.build_for(tpl, tag)
                except TemplateUnavailable as exc:
                    raise ApiError(404, str(exc)) from exc
            return JSONResponse({"templateID": tpl.template_id, "public": False})
        try:
            t = await visible(alias, key)
        except TemplateUnavailable as exc:
            raise ApiError(404, f"template '{alias}' not found") from exc
        return JSONResponse({"templateID": t.name, "public": False})

    @app.get("/templates/{template_id}", tags=["templates"])
    async def get_template(
        template_id: str,
        key: Auth,
        limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = MAX_PAGE,
        nextToken: str | None = None,
    ) -> JSONResponse:
        """E2B's TemplateWithBuilds: builds newest first, `limit` a page (`x-next-token`)."""
        name = split_name(template_id)[0]
        tpl = await own_template(name, key)
        if tpl is None:
            if await builds.state.template(name) is not None:
                raise ApiError(404, f"template {template_id!r} not found")
            try:
                t = await visible(template_id, key)
            except TemplateUnavailable as exc:
                raise ApiError(404, f"template {template_id!r} not found") from exc
            body = views.template(
                t, mgr.envd_version, (await mgr.store.spawns(key.team_id)).get(t.name)
            )
            body["builds"] = []
            return JSONResponse(body)
        body = await builds.template_view(tpl, await mgr.store.spawns(key.team_id))
        rows = await builds.build_rows(tpl)
        start = _decode_offset(nextToken) if nextToken else 0
        body["builds"] = rows[start : start + limit]
        more = start + limit < len(rows)
        headers = {"x-next-token": _encode_offset(start + limit)} if more else {}
        return JSONResponse(body, headers=headers)

    @app.delete("/templates/{template_id}", status_code=204, tags=["templates"])
    async def delete_template(template_id: str, key: Auth) -> Response:
        """E2B's rule: refused (400) while running or paused sandboxes use the template.
        A built template or snapshot: only its team's keys; a catalog template (public):
        only the default team's, the server operator's."""
        name = split_name(template_id)[0]
        tpl = await own_template(name, key)
        if tpl is not None:
            refused = await builds.refuse_delete(tpl)
            if refused is not None:
                return refused
            await builds.delete_template(tpl)
            return Response(status_code=204)
        if (
            await builds.state.template(name) is not None
            or await built.internal(template_id)
            or not await tenancy.template_visible(template_id, key.team_id)
        ):
            raise ApiError(404, f"template {template_id!r} not found")
        if template_id in await tenancy.catalog_names() and key.team_id != DEFAULT_TEAM:
            raise ApiError(
                403,
                f"template {template_id!r} is a public catalog template; only the "
                f"'{DEFAULT_TEAM}' team's keys may delete it",
            )
        users = [
            r
            for r in await mgr.store.select(LIVE_STATES)
            if template_id in (r.template, r.alias) and views.user_sandbox(r)
        ]
        if any(r.state is not SandboxState.PAUSED for r in users):
            raise ApiError(
                400,
                f"cannot delete template '{template_id}' because there are running sandboxes "
                "using it",
            )
        if users:
            raise ApiError(
                400,
                f"cannot delete template '{template_id}' because there are paused sandboxes "
                "using it",
            )
        if not await ctx.templates.delete(template_id):
            raise ApiError(404, f"template {template_id!r} not found")
        return Response(status_code=204)

    # Routes the SDK knows that this server does not implement answer clearly, not 404.
    @app.put("/sandboxes/{sandbox_id}/network", status_code=204, tags=["sandboxes"])
    async def update_network(sandbox_id: str, key: Auth, body: NetworkUpdate) -> Response:
        await owned(sandbox_id, key)
        # E2B replaces the whole egress config: what the body leaves out is cleared.
        named = [k for k in ("egressProxy", "rules") if getattr(body, k) is not None]
        if named:
            raise ApiError(400, f"{', '.join(named)}: not enforced by this server yet")
        _check_targets("", body.allowOut, body.denyOut, body.dnsServers)
        allow_internet = True if body.allowInternetAccess is None else body.allowInternetAccess
        await mgr.update_network(
            sandbox_id,
            allow_internet,
            list(body.allowOut or []),
            list(body.denyOut or []),
            None if body.dnsServers is None else list(body.dnsServers),
        )
        return Response(status_code=204)

    unsupported = {
        "/sandboxes/metrics": ["GET"],
    }
    for path, methods in unsupported.items():
        app.add_api_route(path, _not_implemented, methods=methods, include_in_schema=False)

    return app


# Egress policy this server does not enforce yet: refused by name, never stored and ignored.
_UNENFORCED_NETWORK = (
    "egressProxy",
    "rules",
)


def _refuse_unenforced(body: NewSandbox, network: dict[str, object]) -> None:
    named = [f"network.{k}" for k in _UNENFORCED_NETWORK if k in network]
    if named:
        raise ApiError(400, f"{', '.join(named)}: not enforced by this server yet")
    try:
        check_ingress(network)
    except BadIngress as exc:
        raise ApiError(400, str(exc)) from exc
    if body.iam is not None:
        raise ApiError(400, "iam: workload identity is not supported by this server")
    if body.network is not None:
        net = body.network
        _check_targets("network.", net.allowOut, net.denyOut, net.dnsServers)


def _check_targets(
    prefix: str, allow: list[str] | None, deny: list[str] | None, dns: list[str] | None
) -> None:
    """allowOut/denyOut entries are IPv4 CIDRs, addresses or domain names, dnsServers IPv4
    addresses; anything else is a 400 naming the entry."""
    try:
        Egress.of(allow_out=allow or [], deny_out=deny or [], dns_servers=dns, prefix=prefix)
    except BadTarget as exc:
        raise ApiError(400, str(exc)) from exc


async def _not_implemented(request: Request) -> JSONResponse:
    return error(501, f"{request.method} {request.url.path} is not supported by this server yet")


def _metric_sample(rec: SandboxRecord, m: dict[str, Any]) -> dict[str, Any]:
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


def _parse_states(raw: list[str]) -> set[str]:
    values = {s.strip() for item in raw for s in item.split(",") if s.strip()}
    if not values:
        return {"running", "paused"}
    bad = values - {"running", "paused"}
    if bad:
        raise BadRequest(f"unknown state filter {sorted(bad)[0]!r}: use running or paused")
    return values


def _parse_metadata(raw: str | None, *, encoded_twice: bool) -> dict[str, str]:
    """Decode the SDK's metadata filter (v2: ``urlencode({quote(k): quote(v)})``, sent encoded)."""
    if not raw:
        return {}
    pairs = parse_qsl(raw, keep_blank_values=True)
    if encoded_twice:
        return {unquote(k): unquote(v) for k, v in pairs}
    return dict(pairs)


def _parse_time(raw: str) -> int:
    """``startedAfter`` in microseconds since the epoch (finer digits are dropped, as E2B's
    truncation; no offset means UTC)."""
    try:
        return views.micros_of(datetime.fromisoformat(raw.replace("Z", "+00:00")))
    except ValueError as exc:
        raise BadRequest(f"startedAfter {raw!r} is not an ISO-8601 time") from exc


def _encode_token(us: int, sandbox_id: str, desc: bool) -> str:
    # E2B's cursor: base64url("{RFC 3339 time}__{id}"), plus "__asc" for ascending pages.
    raw = f"{views.iso_micros(us)}__{sandbox_id}" + ("" if desc else "__asc")
    return base64.urlsafe_b64encode(raw.encode()).decode()


def _decode_token(token: str, desc: bool) -> tuple[int, str]:
    """The (start time, id) a page continues after; the token must be for this order."""
    try:
        raw = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4)).decode()
        parts = raw.split("__")
        if len(parts) not in (2, 3) or (len(parts) == 3 and parts[2] != "asc") or not parts[1]:
            raise ValueError(raw)
        us = views.micros_of(datetime.fromisoformat(parts[0].replace("Z", "+00:00")))
    except ValueError as exc:
        raise BadRequest("nextToken is not a token this server issued") from exc
    if (len(parts) == 2) != desc:
        raise BadRequest(
            f"nextToken was issued for order={'desc' if len(parts) == 2 else 'asc'}, "
            f"not order={'desc' if desc else 'asc'}"
        )
    return us, parts[1]


def _encode_offset(offset: int) -> str:
    return base64.urlsafe_b64encode(f"seq:{offset}".encode()).decode().rstrip("=")


def _decode_offset(token: str) -> int:
    try:
        raw = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4)).decode()
        kind, _, offset = raw.partition(":")
        if kind != "seq":
            raise ValueError(raw)
        return int(offset)
    except ValueError as exc:
        raise BadRequest("nextToken is not a token this server issued") from exc
