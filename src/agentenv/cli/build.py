"""`aenv build`, `aenv pull` and `aenv template logs`: template builds over the server's API.

`aenv build` hands the Dockerfile to the E2B SDK's own parser and uploader (`Template
.from_dockerfile` + `Template.build_in_background`), so COPY/ADD sources are hashed, tarred
and uploaded exactly as the SDK does; the SDK is an optional dependency (`pip install e2b`).
`aenv pull` needs no SDK: a build with `fromImage` and no steps, two API calls. Both then
follow the build (`cli.follow`): the log, and progress bars while an image is pulled.
The commands are plain functions; `cli.client` registers them on its apps.
"""

from __future__ import annotations

import os
import re
import sys
import time
from pathlib import Path
from typing import Annotated, Any

import typer

from agentenv.cli.connection import Api, ClientError, _api, _guard, err, resolve_target
from agentenv.cli.follow import follow_build, format_entry

FOLLOW_DEADLINE_S = 6 * 3600.0
POLL_S = 0.5
_NAME_BAD = re.compile(r"[^a-z0-9._-]+")


def _print_entry(entry: dict[str, Any]) -> None:
    typer.echo(format_entry(entry))


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
        try:
            # In the background: uploads and the start go through the SDK, the following is
            # ours (the SDK's log callback would not show an image pull's progress).
            info = Template.build_in_background(
                template, name, cpu_count=cpu, memory_mb=memory, skip_cache=no_cache
            )
        except Exception as exc:
            raise ClientError(str(exc)) from exc
        follow_build(Api(target), info.template_id, info.build_id, err)
        err.print(f"built template {info.template_id} (build {info.build_id})")

    _guard(run)


def default_name(ref: str) -> str:
    """The template name `aenv pull REF` gives: the repository's last part, then the tag
    unless it is ``latest`` (``python:3.11-slim`` → ``python-3.11-slim``), or the digest's
    first 12 hex digits; lowercased, other characters as ``-``, at most 63."""
    from agentenv.oci.errors import InvalidReference
    from agentenv.oci.reference import parse

    try:
        reference = parse(ref)
    except InvalidReference as exc:
        raise ClientError(str(exc)) from exc
    name = reference.repository.rsplit("/", 1)[-1]
    if reference.digest:
        name += "-" + reference.digest.split(":", 1)[1][:12]
    elif reference.tag and reference.tag != "latest":
        name += "-" + reference.tag
    name = _NAME_BAD.sub("-", name.lower()).strip("-._")[:63].rstrip("-._")
    if not name:
        raise ClientError(f"cannot make a template name from {ref!r}: pass --name")
    return name


def pull(
    ref: Annotated[
        str,
        typer.Argument(
            help="Image reference, as docker pull takes it (host:port/repo:tag, repo@sha256:…)."
        ),
    ],
    name: Annotated[
        str | None,
        typer.Option("--name", "-n", help="Template name (default: from the reference)."),
    ] = None,
    start_cmd: Annotated[
        str | None, typer.Option("--start-cmd", help="Command started in every sandbox.")
    ] = None,
    ready_cmd: Annotated[
        str | None,
        typer.Option("--ready-cmd", help="Command that succeeds once --start-cmd is ready."),
    ] = None,
    username: Annotated[
        str | None,
        typer.Option(
            "--username",
            "-u",
            envvar="AENV_REGISTRY_USERNAME",
            help="Registry user name.",
        ),
    ] = None,
    password: Annotated[
        str | None,
        typer.Option(
            "--password",
            "-p",
            envvar="AENV_REGISTRY_PASSWORD",
            help="Registry password or token.",
        ),
    ] = None,
    password_stdin: Annotated[
        bool, typer.Option("--password-stdin", help="Read the password from stdin.")
    ] = False,
    cpu: Annotated[int | None, typer.Option("--cpu", help="vCPUs of the template.")] = None,
    memory: Annotated[int | None, typer.Option("--memory", help="Memory (MB).")] = None,
    no_cache: Annotated[bool, typer.Option("--no-cache", help="Ignore the step cache.")] = False,
) -> None:
    """Make a template from an OCI image (pulled by the server), with progress bars."""

    def run() -> None:

        secret = password
        if password_stdin:
            secret = sys.stdin.readline().rstrip("\r\n")
        if (username is None) != (secret is None):
            raise ClientError("--username and --password (or --password-stdin) go together")
        template = name or default_name(ref)
        api = Api(resolve_target())
        request: dict[str, Any] = {"name": template}
        if cpu is not None:
            request["cpuCount"] = cpu
        if memory is not None:
            request["memoryMB"] = memory
        created = api.call("POST", "/v3/templates", json=request).json()
        template_id, build_id = created["templateID"], created["buildID"]
        start: dict[str, Any] = {"fromImage": ref, "steps": [], "force": no_cache}
        if username is not None and secret is not None:
            start["fromImageRegistry"] = {
                "type": "registry",
                "username": username,
                "password": secret,
            }
        if start_cmd:
            start["startCmd"] = start_cmd
        if ready_cmd:
            start["readyCmd"] = ready_cmd
        api.call("POST", f"/v2/templates/{template_id}/builds/{build_id}", json=start)
        follow_build(api, template_id, build_id, err)
        err.print(f"template {template_id} ready (build {build_id}, from {ref})")

    _guard(run)
