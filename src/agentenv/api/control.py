"""The E2B-compatible control plane (v1 and v2 routes) as one FastAPI app, assembled from the
route modules: `templates` (builds), `build_progress`, `sandbox_create`, `sandbox_routes` and
`template_reads` (`api.app` adds `nodes`).

Every error leaves through `api.errors` (the one error map): ``{"code": int, "message": str}``.
"""

from __future__ import annotations

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from agentenv.api.auth import Auth
from agentenv.api.build_progress import mount_build_progress
from agentenv.api.context import ControlContext
from agentenv.api.errors import error, install_error_map
from agentenv.api.sandbox_create import mount_create
from agentenv.api.sandbox_routes import mount_sandbox_routes
from agentenv.api.template_reads import mount_template_reads
from agentenv.api.templates import mount_templates


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
    tenancy = builds.tenancy

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

    mount_create(app, ctx, builds)
    mount_sandbox_routes(app, ctx, builds)
    mount_template_reads(app, ctx, builds)

    # Routes the SDK knows that this server does not implement answer clearly, not 404.
    unsupported = {
        "/sandboxes/metrics": ["GET"],
    }
    for path, methods in unsupported.items():
        app.add_api_route(path, _not_implemented, methods=methods, include_in_schema=False)

    return app


async def _not_implemented(request: Request) -> JSONResponse:
    return error(501, f"{request.method} {request.url.path} is not supported by this server yet")
