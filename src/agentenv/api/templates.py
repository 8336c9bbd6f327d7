"""E2B's template build API (what the SDK's `Template.build` speaks), mounted on the control
app by `mount_templates`. The wire contract is in docs/template-build.md.

A template's id is its name (so the older routes, `GET /templates/aliases/{alias}`,
`GET`/`DELETE /templates/{id}`, and `Sandbox.create(name)` all see the same thing); build
ids are UUIDs, as the SDK parses them.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import os
import re
import secrets
import time
import uuid
from collections.abc import Iterable
from typing import Annotated, Any

from fastapi import FastAPI, Query, Request, Response
from fastapi.responses import JSONResponse

from agentenv.build.builder import Builder, template_record
from agentenv.build.spec import SpecError, parse
from agentenv.build.state import LEVELS, BuildRecord, BuildState, LogLine
from agentenv.config import Settings
from agentenv.orchestrator.runtime import TemplateUnavailable
from agentenv.template.catalog import TemplateCatalog, TemplateNotFound

STATUS_PAGE = 100
DEFAULT_TAG = "latest"
_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{0,62}$")
_TAG_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_HASH_RE = re.compile(r"^[A-Za-z0-9]{1,128}$")
_REQUEST_FIELDS = ("name", "alias", "tags", "cpuCount", "memoryMB", "minFreeDiskMb", "teamID")


def _err(status: int, message: str) -> JSONResponse:
    return JSONResponse({"code": status, "message": message}, status_code=status)


class TemplateBuilds:
    """State, builder and upload signing for one control app."""

    def __init__(self, ctx: Any, settings: Settings) -> None:
        self.ctx = ctx
        self.settings = settings
        self.state = BuildState(settings.home / "template-builds")
        self.builder = Builder(ctx.manager, settings, self.state)
        self.catalog = TemplateCatalog(settings)
        # Upload links are signed, not authenticated: the SDK sends no API key with them.
        self._secret = secrets.token_bytes(32)

    async def start(self) -> None:
        await self.builder.start()

    async def close(self) -> None:
        await self.builder.close()

    def sign(self, template_id: str, files_hash: str, expires: int) -> str:
        msg = f"{template_id}\n{files_hash}\n{expires}".encode()
        return hmac.new(self._secret, msg, hashlib.sha256).hexdigest()


def _settings_of(ctx: Any) -> Settings:
    found = getattr(ctx.templates, "settings", None)
    return found if isinstance(found, Settings) else Settings.from_env()


def split_name(raw: str) -> tuple[str, str | None]:
    name, sep, tag = raw.partition(":")
    return name, (tag if sep else None)


def mount_templates(app: FastAPI, ctx: Any) -> TemplateBuilds:
    builds = TemplateBuilds(ctx, _settings_of(ctx))
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
            return _err(400, "request body must be a JSON object")
        extra = sorted(set(body) - set(fields))
        if extra:
            return _err(400, f"{extra[0]}: unknown field")
        return body

    async def auth(request: Request) -> Any:
        from agentenv.api.control import api_key

        return api_key(
            request,
            request.headers.get("x-api-key"),
            request.headers.get("authorization"),
        )

    def build_of(template_id: str, build_id: str) -> BuildRecord | JSONResponse:
        rec = state.build(build_id)
        if rec is None or rec.template_id != template_id:
            return _err(404, f"build {build_id} of template {template_id!r} not found")
        return rec

    @app.post("/v3/templates", status_code=202, tags=["templates"])
    async def request_build(request: Request) -> Response:
        key = await auth(request)
        del key
        body = await object_of(request, _REQUEST_FIELDS)
        if isinstance(body, JSONResponse):
            return body
        if body.get("teamID") is not None:
            return _err(400, "teamID: teams are not supported by this server")
        if body.get("minFreeDiskMb"):
            return _err(400, "minFreeDiskMb: growing the disk after the build is not supported yet")
        raw = body.get("name") or body.get("alias")
        if not isinstance(raw, str) or not raw:
            return _err(400, "name: required ('name' or 'name:tag')")
        name, tag = split_name(raw)
        if not _NAME_RE.match(name):
            return _err(400, f"name {name!r}: use 1-63 of a-z 0-9 . _ -, starting alphanumeric")
        tags_raw = body.get("tags") or []
        if not isinstance(tags_raw, list) or not all(isinstance(t, str) for t in tags_raw):
            return _err(400, "tags: must be a list of strings")
        tags = ([tag] if tag else []) + [t for t in tags_raw if t != tag]
        if not tags:
            tags = [DEFAULT_TAG]
        bad = [t for t in tags if not _TAG_RE.match(t)]
        if bad:
            return _err(400, f"tags: {bad[0]!r} is not a valid tag")
        cpu, memory = body.get("cpuCount"), body.get("memoryMB")
        for field_name, value in (("cpuCount", cpu), ("memoryMB", memory)):
            if value is not None and (not isinstance(value, int) or value < 1):
                return _err(400, f"{field_name}: must be a positive integer")
        try:
            await asyncio.to_thread(builds.catalog.get, name)
        except TemplateNotFound:
            pass
        else:
            return _err(409, f"template {name!r} is a built-in template; choose another name")
        tpl = state.template(name) or template_record(name)
        build_id = str(uuid.uuid4())
        tpl.builds.append(build_id)
        tpl.cpu, tpl.memory_mb = cpu, memory
        state.put_template(tpl)
        state.put_build(
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
        await auth(request)
        if state.template(template_id) is None:
            return _err(404, f"template {template_id!r} not found")
        if not _HASH_RE.match(files_hash):
            return _err(400, f"files hash {files_hash!r} is not a hash")
        if state.files_path(files_hash).exists():
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
            return _err(
                403, "upload link is invalid or expired; ask GET /templates/{id}/files/{hash} again"
            )
        final = state.files_path(files_hash)
        tmp = final.with_name(f".{final.name}.{secrets.token_hex(4)}")
        f = await asyncio.to_thread(tmp.open, "wb")
        try:
            async for chunk in request.stream():
                await asyncio.to_thread(f.write, chunk)
            await asyncio.to_thread(f.close)
            await asyncio.to_thread(os.replace, tmp, final)
        except BaseException:
            f.close()
            tmp.unlink(missing_ok=True)
            raise
        return Response(status_code=200)

    @app.post("/v2/templates/{template_id}/builds/{build_id}", status_code=202, tags=["templates"])
    async def start_build(template_id: str, build_id: str, request: Request) -> Response:
        key = await auth(request)
        found = build_of(template_id, build_id)
        if isinstance(found, JSONResponse):
            return found
        if found.status != "waiting" or builds.builder.running(build_id):
            return _err(409, f"build {build_id} was already started ({found.status})")
        try:
            spec = parse(await body_of(request))
        except SpecError as exc:
            return _err(400, str(exc))
        for i, step in enumerate(spec.steps):
            if step.files_hash and not state.files_path(step.files_hash).exists():
                return _err(
                    400,
                    f"steps[{i}].filesHash {step.files_hash}: not uploaded; ask "
                    f"GET /templates/{template_id}/files/{step.files_hash} for the upload link",
                )
        if spec.from_template:
            try:
                builds.ctx.templates.get(spec.from_template)
            except TemplateUnavailable:
                return _err(400, f"fromTemplate: template {spec.from_template!r} not found")
        builds.builder.submit(found, spec, key.id)
        return Response(status_code=202)

    def level_ok(line: LogLine, level: str | None) -> bool:
        return level is None or LEVELS.index(line.level) >= LEVELS.index(level)

    def check_level(level: str | None) -> JSONResponse | None:
        if level is not None and level not in LEVELS:
            return _err(400, f"level {level!r}: use one of {', '.join(LEVELS)}")
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
        await auth(request)
        found = build_of(template_id, build_id)
        if isinstance(found, JSONResponse):
            return found
        if (bad := check_level(level)) is not None:
            return bad
        lines = [line for line in state.logs(build_id) if level_ok(line, level)]
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
        await auth(request)
        found = build_of(template_id, build_id)
        if isinstance(found, JSONResponse):
            return found
        if (bad := check_level(level)) is not None:
            return bad
        if direction not in ("forward", "backward"):
            return _err(400, f"direction {direction!r}: use forward or backward")
        if source not in (None, "persistent", "temporary"):
            return _err(400, f"source {source!r}: use persistent or temporary")
        lines = [line for line in state.logs(build_id) if level_ok(line, level)]
        if direction == "forward":
            lines = [x for x in lines if cursor is None or x.timestamp * 1000 >= cursor]
        else:
            lines = [x for x in reversed(lines) if cursor is None or x.timestamp * 1000 <= cursor]
        return JSONResponse({"logs": [line.wire() for line in lines[:limit]]})

    @app.get("/templates/{template_id}/builds", tags=["templates"])
    async def list_builds(template_id: str, request: Request) -> Response:
        """Not an E2B route: the builds of a template, newest first (`aenv template logs`)."""
        await auth(request)
        tpl = state.template(template_id)
        if tpl is None:
            return _err(404, f"template {template_id!r} has no builds")
        rows = []
        for bid in reversed(tpl.builds):
            rec = state.build(bid)
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

    def tag_rows(template_id: str) -> list[dict[str, Any]]:
        tpl = state.template(template_id)
        if tpl is None:
            return []
        rows = []
        for tag, bid in sorted(tpl.tags.items()):
            rec = state.build(bid)
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
        await auth(request)
        if state.template(template_id) is None:
            return _err(404, f"template {template_id!r} not found")
        return JSONResponse(tag_rows(template_id))

    @app.post("/templates/tags", status_code=201, tags=["tags"])
    async def assign_tags(request: Request) -> Response:
        await auth(request)
        body = await object_of(request, {"target", "tags"})
        if isinstance(body, JSONResponse):
            return body
        target, tags = body.get("target"), body.get("tags")
        if not isinstance(target, str) or not isinstance(tags, list) or not tags:
            return _err(400, "target ('name:tag') and tags (a non-empty list) are required")
        name, tag = split_name(target)
        tpl = state.template(name)
        if tpl is None:
            return _err(404, f"template {name!r} not found")
        bid = tpl.tags.get(tag or DEFAULT_TAG)
        if bid is None:
            return _err(404, f"template {name!r} has no tag {tag or DEFAULT_TAG!r}")
        bad = [t for t in tags if not isinstance(t, str) or not _TAG_RE.match(t)]
        if bad:
            return _err(400, f"tags: {bad[0]!r} is not a valid tag")
        for t in tags:
            tpl.tags[t] = bid
        state.put_template(tpl)
        return JSONResponse({"tags": tags, "buildID": bid}, status_code=201)

    @app.delete("/templates/tags", status_code=204, tags=["tags"])
    async def remove_tags(request: Request) -> Response:
        await auth(request)
        body = await object_of(request, {"name", "tags"})
        if isinstance(body, JSONResponse):
            return body
        name, tags = body.get("name"), body.get("tags")
        if not isinstance(name, str) or not isinstance(tags, list):
            return _err(400, "name and tags are required")
        tpl = state.template(split_name(name)[0])
        if tpl is None:
            return _err(404, f"template {name!r} not found")
        missing = [t for t in tags if t not in tpl.tags]
        if missing:
            return _err(404, f"template {tpl.name!r} has no tag {missing[0]!r}")
        for t in tags:
            tpl.tags.pop(t, None)
        state.put_template(tpl)
        return Response(status_code=204)

    return builds
