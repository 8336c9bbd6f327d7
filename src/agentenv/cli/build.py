"""`aenv build` and `aenv template logs`: template builds over the server's API.

`aenv build` hands the Dockerfile to the E2B SDK's own parser and builder (`Template
.from_dockerfile` + `Template.build`), so COPY/ADD sources are hashed, tarred and uploaded
exactly as the SDK does; the SDK is an optional dependency (`pip install e2b`).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Annotated, Any

import typer

from agentenv.cli.client import (
    ClientError,
    _api,
    _guard,
    client_app,
    err,
    resolve_target,
    template_app,
)

FOLLOW_DEADLINE_S = 6 * 3600.0
POLL_S = 0.5


def _print_entry(entry: dict[str, Any]) -> None:
    step = entry.get("step")
    prefix = f"[{step}] " if step else ""
    typer.echo(f"{entry.get('timestamp', '')[11:19]} {prefix}{entry.get('message', '')}")


@template_app.command("logs")
def template_logs(
    name: str,
    build: str = typer.Option(None, "--build", help="Build id (default: the newest build)."),
    follow: bool = typer.Option(False, "--follow", "-f", help="Wait for the build to finish."),
) -> None:
    """Print a template build's log (the newest build unless --build)."""

    def run() -> None:
        api = _api()
        build_id = build
        if build_id is None:
            rows = api.call("GET", f"/templates/{name}/builds").json()
            if not rows:
                raise ClientError(f"template {name!r} has no builds")
            build_id = rows[0]["buildID"]
        offset = 0
        deadline = time.monotonic() + FOLLOW_DEADLINE_S
        while True:
            body = api.call(
                "GET",
                f"/templates/{name}/builds/{build_id}/status",
                params={"logsOffset": offset},
            ).json()
            entries = body.get("logEntries", [])
            for entry in entries:
                _print_entry(entry)
            offset += len(entries)
            done = body["status"] in ("ready", "error")
            if entries:
                continue  # drain every page before deciding
            if done or not follow:
                if body["status"] == "error":
                    reason = body.get("reason") or {}
                    raise ClientError(f"build failed: {reason.get('message', 'unknown')}")
                return
            if time.monotonic() > deadline:
                raise ClientError("gave up following the build")
            time.sleep(POLL_S)

    _guard(run)


@client_app.command("build")
def build(
    context: Annotated[
        Path, typer.Argument(help="Build context (COPY/ADD sources are read here).")
    ],
    name: Annotated[str, typer.Option("--name", "-n", help="Template name (name or name:tag).")],
    file: Annotated[
        Path | None, typer.Option("--file", "-f", help="Dockerfile (default CONTEXT/Dockerfile).")
    ] = None,
    cpu: Annotated[int | None, typer.Option("--cpu", help="vCPUs of the template.")] = None,
    memory: Annotated[int | None, typer.Option("--memory", help="Memory (MB).")] = None,
    no_cache: Annotated[bool, typer.Option("--no-cache", help="Ignore the step cache.")] = False,
) -> None:
    """Build a template from a Dockerfile, printing the build log live."""

    def run() -> None:
        try:
            from e2b import Template
        except ImportError as exc:
            raise ClientError("aenv build needs the E2B SDK: pip install e2b") from exc
        dockerfile = file or context / "Dockerfile"
        if not dockerfile.is_file():
            raise ClientError(f"no Dockerfile at {dockerfile}")
        target = resolve_target()
        os.environ["E2B_API_URL"] = target.url
        os.environ["E2B_API_KEY"] = target.api_key
        template = Template(file_context_path=str(context)).from_dockerfile(dockerfile.read_text())

        def on_log(entry: Any) -> None:
            typer.echo(f"{entry.timestamp:%H:%M:%S} {entry.message}")

        try:
            info = Template.build(
                template,
                name,
                cpu_count=cpu,
                memory_mb=memory,
                skip_cache=no_cache,
                on_build_logs=on_log,
            )
        except Exception as exc:
            raise ClientError(str(exc)) from exc
        err.print(f"built template {info.template_id} (build {info.build_id})")

    _guard(run)
