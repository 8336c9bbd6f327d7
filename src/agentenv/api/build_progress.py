"""`GET /templates/{templateID}/builds/{buildID}/progress`: not an E2B route. The image pull of
a running build, per layer: bytes downloaded and bytes converted into block layers, so a
client can draw progress bars (`aenv pull`, `aenv build`). The status route's log entries
keep E2B's shape ({timestamp, level, message, step}); this is where the numbers are.

    {"templateID", "buildID", "status", "image": ref | null,
     "layers": [{"phase": "download"|"convert", "layer": 1.., "layers": n, "digest",
                 "done", "total", "cached"}]}

`layers` is empty when the build pulls nothing (yet, or any more: a finished pull is dropped,
its log lines stay).
"""

from __future__ import annotations

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse

from agentenv.api.auth import api_key
from agentenv.api.errors import error
from agentenv.api.template_builds import TemplateBuilds


def mount_build_progress(app: FastAPI, builds: TemplateBuilds) -> None:
    @app.get("/templates/{template_id}/builds/{build_id}/progress", tags=["templates"])
    async def build_progress(template_id: str, build_id: str, request: Request) -> Response:
        key = await api_key(
            request, request.headers.get("x-api-key"), request.headers.get("authorization")
        )
        rec = await builds.state.build(build_id)
        if (
            rec is None
            or rec.template_id != template_id
            or await builds.owned(template_id, key.team_id) is None
        ):
            message = f"build {build_id} of template {template_id!r} not found"
            return error(404, message)
        tracker = builds.builder.pulls.get(build_id)
        return JSONResponse(
            {
                "templateID": template_id,
                "buildID": build_id,
                "status": rec.status,
                "image": tracker.image if tracker else None,
                "layers": tracker.wire() if tracker else [],
            }
        )
