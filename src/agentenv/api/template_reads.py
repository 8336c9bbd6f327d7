"""The template reads and deletes of the control plane: list, get (with its builds), the
alias check, delete. Catalog templates, snapshots and built templates answer alike; another
team's are 404s. (Builds themselves are `api.templates`.)"""

from __future__ import annotations

from typing import Annotated

from fastapi import FastAPI, Query, Response
from fastapi.responses import JSONResponse

from agentenv.api import views
from agentenv.api.auth import ApiError, Auth
from agentenv.api.context import ControlContext
from agentenv.api.paging import MAX_PAGE, decode_offset, encode_offset
from agentenv.api.template_builds import TemplateBuilds
from agentenv.api.tenancy import template_team
from agentenv.build.state import TemplateRecord
from agentenv.build.templates import split_name
from agentenv.contract.runtime import TemplateInfo, TemplateUnavailable
from agentenv.control.store import DEFAULT_TEAM, LIVE_STATES, ApiKey, SandboxState


def mount_template_reads(app: FastAPI, ctx: ControlContext, builds: TemplateBuilds) -> None:
    mgr = ctx.manager
    built = builds.built
    tenancy = builds.tenancy

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
        start = decode_offset(nextToken) if nextToken else 0
        body["builds"] = rows[start : start + limit]
        more = start + limit < len(rows)
        headers = {"x-next-token": encode_offset(start + limit)} if more else {}
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
