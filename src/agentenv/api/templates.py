"""E2B's template build API (what the SDK's `Template.build` speaks), mounted on the control
app by `mount_templates`. The wire contract is in docs/template-build.md.

A template's id is its name (so the older routes, `GET /templates/aliases/{alias}`,
`GET`/`DELETE /templates/{id}`, and `Sandbox.create(name)` all see the same thing); build
ids are UUIDs, as the SDK parses them. What `name:tag` resolves to is `build.templates`.

The routes' shared state and steps are `template_builds.TemplateBuilds`.
"""

from __future__ import annotations

import asyncio
import hmac
import secrets
import time
import uuid
from collections.abc import Iterable
from dataclasses import replace
from typing import Annotated, Any

from fastapi import FastAPI, Query, Request, Response
from fastapi.responses import JSONResponse

from agentenv.api.auth import api_key
from agentenv.api.errors import error
from agentenv.api.template_builds import (
    HASH_RE,
    NAME_RE,
    REQUEST_FIELDS,
    STATUS_PAGE,
    TemplateBuilds,
    settings_of,
)
from agentenv.api.tenancy import template_team
from agentenv.build.builder import template_record
from agentenv.build.spec import SpecError, parse
from agentenv.build.state import LEVELS, BuildRecord, LogLine, TemplateRecord
from agentenv.build.templates import DEFAULT_TAG, BadTag, clean_tags, is_internal_name, split_name
from agentenv.contract.runtime import TemplateUnavailable


def mount_templates(app: FastAPI, ctx: Any) -> TemplateBuilds:
    builds = TemplateBuilds(ctx, settings_of(ctx))
    app.state.builds = builds
    state = builds.state

    async def body_of(request: Request) -> Any:
        try:
            return await request.json()
        except ValueError:
            return None

    async def object_of(request: Request, fields: Iterable[str]) -> dict[str, Any] | JSONResponse:
        """The request's JSON object, or the 400 for a body that is not one or that carries
        a field outside `fields` (named: never accepted and ignored)."""
        body = await body_of(request)
        if not isinstance(body, dict):
            return error(400, "request body must be a JSON object")
        extra = sorted(set(body) - set(fields))
        if extra:
            return error(400, f"{extra[0]}: unknown field")
        return body

    async def auth(request: Request) -> Any:
        return await api_key(
            request,
            request.headers.get("x-api-key"),
            request.headers.get("authorization"),
        )

    async def build_of(template_id: str, build_id: str, key: Any) -> BuildRecord | JSONResponse:
        rec = await state.build(build_id)
        if (
            rec is None
            or rec.template_id != template_id
            or await builds.owned(template_id, key.team_id) is None
        ):
            return error(404, f"build {build_id} of template {template_id!r} not found")
        return rec

    @app.post("/v3/templates", status_code=202, tags=["templates"])
    async def request_build(request: Request) -> Response:
        key = await auth(request)
        body = await object_of(request, REQUEST_FIELDS)
        if isinstance(body, JSONResponse):
            return body
        team = body.get("teamID")
        if team is not None and team != key.team_id:
            # A key acts for its own team only (E2B's answer, whether or not that team exists).
            return error(400, "Team ID param mismatch with the API key")
        if body.get("minFreeDiskMb"):
            return error(
                400, "minFreeDiskMb: growing the disk after the build is not supported yet"
            )
        raw = body.get("name") or body.get("alias")
        if not isinstance(raw, str) or not raw:
            return error(400, "name: required ('name' or 'name:tag')")
        name, tag = split_name(raw)
        if not NAME_RE.match(name):
            return error(400, f"name {name!r}: use 1-63 of a-z 0-9 . _ -, starting alphanumeric")
        if is_internal_name(name):
            return error(400, f"name {name!r}: build-cache-* and build-final-* are the builder's")
        tags_raw = body.get("tags") or []
        if not isinstance(tags_raw, list) or not all(isinstance(t, str) for t in tags_raw):
            return error(400, "tags: must be a list of strings")
        try:
            # E2B: the name's tag first, then `tags`; none at all means the default tag.
            tags = clean_tags(([tag] if tag else []) + tags_raw) or [DEFAULT_TAG]
        except BadTag as exc:
            return error(400, f"tags: {exc}")
        cpu, memory = body.get("cpuCount"), body.get("memoryMB")
        for field_name, value in (("cpuCount", cpu), ("memoryMB", memory)):
            if value is not None and (not isinstance(value, int) or value < 1):
                return error(400, f"{field_name}: must be a positive integer")
        if name in await builds.tenancy.catalog_names():
            return error(409, f"template {name!r} is a built-in template; choose another name")
        if await builds.tenancy.name_taken(name, key.team_id):
            # One name space per server: the name is another team's template or snapshot.
            return error(409, f"template name {name!r} is taken; choose another name")
        build_id = str(uuid.uuid4())

        def add_build(tpl: TemplateRecord | None) -> TemplateRecord | None:
            if tpl is not None and template_team(tpl) != key.team_id:
                return None
            tpl = tpl or replace(template_record(name), team_id=key.team_id)
            tpl.builds.append(build_id)
            tpl.cpu, tpl.memory_mb = cpu, memory
            return tpl

        # The build's record first: a template never lists a build that has none.
        await state.put_build(
            BuildRecord(
                build_id=build_id,
                template_id=name,
                status="waiting",
                created_at=time.time(),
                tags=tags,
                cpu=cpu,
                memory_mb=memory,
            )
        )
        tpl = await state.update_template(name, add_build)
        if tpl is None or template_team(tpl) != key.team_id:
            # Another team took the name between the check and the write.
            await state.drop_build(build_id)
            return error(409, f"template name {name!r} is taken; choose another name")
        return JSONResponse(
            {
                "templateID": name,
                "buildID": build_id,
                "public": False,
                "names": [name],
                "tags": tags,
                "aliases": [name],
            },
            status_code=202,
        )

    @app.get("/templates/{template_id}/files/{files_hash}", status_code=201, tags=["templates"])
    async def file_link(template_id: str, files_hash: str, request: Request) -> Response:
        key = await auth(request)
        if await builds.owned(template_id, key.team_id) is None:
            return error(404, f"template {template_id!r} not found")
        if not HASH_RE.match(files_hash):
            return error(400, f"files hash {files_hash!r} is not a hash")
        if await state.has_files(files_hash):
            return JSONResponse({"present": True}, status_code=201)
        expires = int(time.time()) + 3600
        sig = builds.sign(template_id, files_hash, expires)
        base = str(request.base_url).rstrip("/")
        path = f"/templates/{template_id}/files/{files_hash}/upload"
        url = f"{base}{path}?expires={expires}&sig={sig}"
        return JSONResponse({"present": False, "url": url}, status_code=201)

    @app.put("/templates/{template_id}/files/{files_hash}/upload", tags=["templates"])
    async def file_upload(
        template_id: str, files_hash: str, request: Request, expires: int = 0, sig: str = ""
    ) -> Response:
        good = builds.sign(template_id, files_hash, expires)
        if not hmac.compare_digest(good, sig) or expires < time.time():
            return error(
                403, "upload link is invalid or expired; ask GET /templates/{id}/files/{hash} again"
            )
        tmp = state.staging() / f".{files_hash}.{secrets.token_hex(4)}.upload"
        f = await asyncio.to_thread(tmp.open, "wb")
        try:
            async for chunk in request.stream():
                await asyncio.to_thread(f.write, chunk)
            await asyncio.to_thread(f.close)
            await state.put_files(files_hash, tmp)
        except BaseException:
            f.close()
            tmp.unlink(missing_ok=True)
            raise
        return Response(status_code=200)

    @app.post("/v2/templates/{template_id}/builds/{build_id}", status_code=202, tags=["templates"])
    async def start_build(template_id: str, build_id: str, request: Request) -> Response:
        key = await auth(request)
        found = await build_of(template_id, build_id, key)
        if isinstance(found, JSONResponse):
            return found
        if found.status != "waiting" or builds.builder.running(build_id):
            return error(409, f"build {build_id} was already started ({found.status})")
        try:
            spec = parse(await body_of(request))
        except SpecError as exc:
            return error(400, str(exc))
        for i, step in enumerate(spec.steps):
            if step.files_hash and not await state.has_files(step.files_hash):
                return error(
                    400,
                    f"steps[{i}].filesHash {step.files_hash}: not uploaded; ask "
                    f"GET /templates/{template_id}/files/{step.files_hash} for the upload link",
                )
        if spec.from_template:
            try:
                if await builds.built.internal(
                    spec.from_template
                ) or not await builds.tenancy.template_visible(spec.from_template, key.team_id):
                    raise TemplateUnavailable(spec.from_template)
                await builds.built.get(spec.from_template)
            except TemplateUnavailable as exc:
                return error(
                    400, f"fromTemplate: template {spec.from_template!r} not found ({exc})"
                )
        if not await builds.builder.submit(found, spec, key.id):
            return error(409, f"build {build_id} was already started")
        return Response(status_code=202)

    def level_ok(line: LogLine, level: str | None) -> bool:
        return level is None or LEVELS.index(line.level) >= LEVELS.index(level)

    def check_level(level: str | None) -> JSONResponse | None:
        if level is not None and level not in LEVELS:
            return error(400, f"level {level!r}: use one of {', '.join(LEVELS)}")
        return None

    @app.get("/templates/{template_id}/builds/{build_id}/status", tags=["templates"])
    async def build_status(
        template_id: str,
        build_id: str,
        request: Request,
        logsOffset: Annotated[int, Query(ge=0)] = 0,
        limit: Annotated[int, Query(ge=0, le=STATUS_PAGE)] = STATUS_PAGE,
        level: str | None = None,
    ) -> Response:
        key = await auth(request)
        found = await build_of(template_id, build_id, key)
        if isinstance(found, JSONResponse):
            return found
        if (bad := check_level(level)) is not None:
            return bad
        lines = [line for line in await state.logs(build_id) if level_ok(line, level)]
        page = lines[logsOffset : logsOffset + limit]
        body: dict[str, Any] = {
            "templateID": template_id,
            "buildID": build_id,
            "status": found.status,
            "logs": [],
            "logEntries": [line.wire() for line in page],
        }
        if found.reason is not None:
            body["reason"] = found.reason
        return JSONResponse(body)

    @app.get("/templates/{template_id}/builds/{build_id}/logs", tags=["templates"])
    async def build_logs(
        template_id: str,
        build_id: str,
        request: Request,
        cursor: Annotated[int | None, Query(ge=0)] = None,
        limit: Annotated[int, Query(ge=1, le=1000)] = 100,
        direction: str = "forward",
        level: str | None = None,
        source: str | None = None,
    ) -> Response:
        """E2B's cursor is a time in milliseconds: forward gives lines at or after it,
        backward lines at or before it, newest first."""
        key = await auth(request)
        found = await build_of(template_id, build_id, key)
        if isinstance(found, JSONResponse):
            return found
        if (bad := check_level(level)) is not None:
            return bad
        if direction not in ("forward", "backward"):
            return error(400, f"direction {direction!r}: use forward or backward")
        if source not in (None, "persistent", "temporary"):
            return error(400, f"source {source!r}: use persistent or temporary")
        lines = [line for line in await state.logs(build_id) if level_ok(line, level)]
        if direction == "forward":
            lines = [x for x in lines if cursor is None or x.timestamp * 1000 >= cursor]
        else:
            lines = [x for x in reversed(lines) if cursor is None or x.timestamp * 1000 <= cursor]
        return JSONResponse({"logs": [line.wire() for line in lines[:limit]]})

    @app.get("/templates/{template_id}/builds", tags=["templates"])
    async def list_builds(template_id: str, request: Request) -> Response:
        """Not an E2B route: the builds of a template, newest first (`aenv template logs`)."""
        key = await auth(request)
        tpl = await builds.owned(template_id, key.team_id)
        if tpl is None:
            return error(404, f"template {template_id!r} has no builds")
        rows = []
        for bid in reversed(tpl.builds):
            rec = await state.build(bid)
            if rec is None:
                continue
            rows.append(
                {
                    "buildID": rec.build_id,
                    "status": rec.status,
                    "tags": rec.tags,
                    "createdAt": LogLine(rec.created_at, "info", "").wire()["timestamp"],
                    "reason": rec.reason,
                }
            )
        return JSONResponse(rows)

    # -- tags ------------------------------------------------------------------------------

    async def tag_rows(template_id: str) -> list[dict[str, Any]]:
        tpl = await state.template(template_id)
        if tpl is None:
            return []
        rows = []
        for tag, bid in sorted(tpl.tags.items()):
            rec = await state.build(bid)
            at = rec.finished_at or rec.created_at if rec else tpl.updated_at
            rows.append(
                {
                    "tag": tag,
                    "buildID": bid,
                    "createdAt": LogLine(at, "info", "").wire()["timestamp"],
                }
            )
        return rows

    @app.get("/templates/{template_id}/tags", tags=["tags"])
    async def list_tags(template_id: str, request: Request) -> Response:
        key = await auth(request)
        if await builds.owned(template_id, key.team_id) is None:
            return error(404, f"template {template_id!r} not found")
        return JSONResponse(await tag_rows(template_id))

    @app.post("/templates/tags", status_code=201, tags=["tags"])
    async def assign_tags(request: Request) -> Response:
        """E2B's: the build `target` (`name` = `name:default`) names gets `tags` too; a tag
        that named another build moves."""
        key = await auth(request)
        body = await object_of(request, {"target", "tags"})
        if isinstance(body, JSONResponse):
            return body
        target, tags = body.get("target"), body.get("tags")
        if not isinstance(target, str) or not isinstance(tags, list):
            return error(400, "target ('name:tag') and tags (a list) are required")
        if not tags or not all(isinstance(t, str) for t in tags):
            return error(400, "tags: at least one tag (a string) is required")
        try:
            tags = clean_tags(tags)
        except BadTag as exc:
            return error(400, f"tags: {exc}")
        name, tag = split_name(target)
        tpl = await builds.owned(name, key.team_id)
        if tpl is None:
            return error(404, f"template '{name}' not found")
        try:
            bid = (await builds.built.build_for(tpl, tag)).build_id
        except TemplateUnavailable:
            return error(404, f"Template '{target}' with tag '{tag or DEFAULT_TAG}' not found")

        def assign(found: TemplateRecord | None) -> TemplateRecord | None:
            if found is None:
                return None
            for t in tags:
                found.tags[t] = bid
            found.updated_at = time.time()
            return found

        if await state.update_template(name, assign) is None:
            return error(404, f"template '{name}' not found")
        return JSONResponse({"tags": tags, "buildID": bid}, status_code=201)

    @app.delete("/templates/tags", status_code=204, tags=["tags"])
    async def remove_tags(request: Request) -> Response:
        """E2B's: tags the template does not have are no error; `default` cannot go."""
        key = await auth(request)
        body = await object_of(request, {"name", "tags"})
        if isinstance(body, JSONResponse):
            return body
        name, tags = body.get("name"), body.get("tags")
        if not isinstance(name, str) or not isinstance(tags, list):
            return error(400, "name and tags are required")
        if not all(isinstance(t, str) for t in tags):
            return error(400, "tags: must be a list of strings")
        try:
            tags = clean_tags(tags)
        except BadTag as exc:
            return error(400, f"tags: {exc}")
        if not tags:
            return error(400, "tags: at least one tag is required")
        if DEFAULT_TAG in tags:
            return error(400, f"Cannot delete the '{DEFAULT_TAG}' tag")
        base, tag = split_name(name)
        if tag is not None:
            return error(400, "name: give the template's name without a tag (tags go in 'tags')")
        if await builds.owned(base, key.team_id) is None:
            return error(404, f"template '{name}' not found")

        def remove(found: TemplateRecord | None) -> TemplateRecord | None:
            if found is None:
                return None
            for t in tags:
                found.tags.pop(t, None)
            found.updated_at = time.time()
            return found

        await state.update_template(base, remove)
        return Response(status_code=204)

    return builds
