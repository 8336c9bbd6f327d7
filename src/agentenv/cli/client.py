"""`aenv` client commands: talk to an agentenv server over its E2B-compatible HTTP API.

Control-plane calls use the REST routes; commands and shells go through the server's proxy to
envd's Connect-RPC (``process.Process``), exactly the way the E2B SDK reaches a sandbox.
Every failure ends as one readable line on stderr and a non-zero exit code.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
from pathlib import Path
from typing import Annotated, Any

import httpx
import typer

from agentenv.cli import build
from agentenv.cli.admin import keys_app, teams_app
from agentenv.cli.connection import (
    DEFAULT_URL,
    Api,
    ClientError,
    Target,
    _api,
    _fail,
    _guard,
    config_path,
    err,
)
from agentenv.cli.output import emit
from agentenv.cli.process_stream import exec_command, shell

client_app = typer.Typer(no_args_is_help=True, add_completion=False)
template_app = typer.Typer(help="Templates on the server.", no_args_is_help=True)
client_app.add_typer(template_app, name="template")
client_app.add_typer(keys_app, name="keys")
client_app.add_typer(teams_app, name="teams")


# -- server ----------------------------------------------------------------------------------


@client_app.command()
def serve(
    host: Annotated[
        str | None,
        typer.Option("--host", help="Bind address (default 127.0.0.1, or AGENTENV_BIND)."),
    ] = None,
    port: Annotated[int | None, typer.Option("--port", help="Port (default 8000).")] = None,
    cert: Annotated[Path | None, typer.Option("--cert", help="TLS certificate (PEM).")] = None,
    key: Annotated[Path | None, typer.Option("--key", help="TLS private key (PEM).")] = None,
    domain: Annotated[
        str | None, typer.Option("--domain", help="Sandbox domain for {port}-{id}.{domain} hosts.")
    ] = None,
    log_level: Annotated[str, typer.Option("--log-level")] = "info",
) -> None:
    """Run the server: E2B-compatible API and sandbox proxy on one port."""
    from agentenv.api.server import serve as run_server
    from agentenv.config_env import ConfigError

    try:
        run_server(
            host,
            port,
            certfile=cert,
            keyfile=key,
            domain=domain,
            log_level=log_level,
        )
    except (ConfigError, OSError) as exc:
        _fail(str(exc))


# -- configuration ---------------------------------------------------------------------------


@client_app.command()
def auth(
    url: str = typer.Option(DEFAULT_URL, "--url", help="Server URL."),
    key: str = typer.Option(None, "--key", help="API key (prompted for if omitted)."),
) -> None:
    """Store the server URL and API key for the other commands."""
    if not key:
        key = typer.prompt("API key", hide_input=True)

    def run() -> None:
        Api(Target(url.rstrip("/"), key)).call("GET", "/v2/sandboxes", params={"limit": 1})
        path = config_path()
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as fh:
            json.dump({"url": url.rstrip("/"), "api_key": key}, fh)
        err.print(f"saved credentials for {url} to {path}")

    _guard(run)


# -- templates -------------------------------------------------------------------------------


@template_app.command("ls")
def template_ls() -> None:
    """List templates: the catalog's and those built with `aenv build` / the E2B SDK (for
    these, the build `name` resolves to and the status of the newest such build)."""
    rows = _guard(lambda: _api().call("GET", "/templates").json())
    emit(
        rows,
        [("NAME", "templateID"), ("STATUS", "buildStatus"), ("BUILDS", "buildCount"),
         ("DISK MB", "diskSizeMB"), ("CPU", "cpuCount"), ("MEMORY MB", "memoryMB"),
         ("SPAWNS", "spawnCount"), ("CREATED", "createdAt")],
    )  # fmt: skip


@template_app.command("rm")
def template_rm(name: str) -> None:
    """Delete a template (refused while sandboxes use it)."""
    _guard(lambda: _api().call("DELETE", f"/templates/{name}"))
    err.print(f"deleted template {name}")


# -- sandboxes -------------------------------------------------------------------------------


@client_app.command("ls")
def ls(
    state: str = typer.Option(None, "--state", help="running, paused or both (comma-separated)."),
    metadata: Annotated[
        list[str] | None, typer.Option("--metadata", "-m", help="KEY=VALUE filter.")
    ] = None,
    wide: bool = typer.Option(
        False, "--wide", "-w", help="Also CPU, memory and host memory (PSS) columns."
    ),
) -> None:
    """List sandboxes (a table on a terminal, JSON when piped)."""

    def run() -> list[dict[str, Any]]:
        api = _api()
        params: dict[str, str] = {"limit": "100"}
        if state:
            params["state"] = state
        if metadata:
            pairs = [m.split("=", 1) for m in metadata]
            if any(len(p) != 2 for p in pairs):
                raise ClientError("--metadata takes KEY=VALUE")
            from urllib.parse import quote, urlencode

            params["metadata"] = urlencode({quote(k): quote(v) for k, v in pairs})
        rows: list[dict[str, Any]] = []
        for _ in range(1000):
            resp = api.call("GET", "/v2/sandboxes", params=params)
            rows += resp.json()
            token = resp.headers.get("x-next-token")
            if not token:
                break
            params["nextToken"] = token
        return rows

    rows = _guard(run)
    columns = [("ID", "sandboxID"), ("TEMPLATE", "templateID"), ("STATE", "state"),
               ("STARTED", "startedAt"), ("ENDS", "endAt"), ("METADATA", "metadata")]  # fmt: skip
    if wide:
        # hostMemoryPssMB: what the sandbox's VM really holds on the host (running only).
        columns[3:3] = [("CPU", "cpuCount"), ("MEMORY MB", "memoryMB"),
                        ("HOST PSS MB", "hostMemoryPssMB")]  # fmt: skip
    emit(rows, columns)


@client_app.command()
def start(
    template: str = typer.Argument("base"),
    detach: bool = typer.Option(False, "-d", "--detach", help="Create and print the id only."),
    timeout: int = typer.Option(300, "--timeout", "-t", help="Sandbox lifetime in seconds."),
    metadata: Annotated[
        list[str] | None, typer.Option("--metadata", "-m", help="KEY=VALUE.")
    ] = None,
    env: Annotated[
        list[str] | None, typer.Option("--env", "-e", help="KEY=VALUE environment variable.")
    ] = None,
    keep: bool = typer.Option(False, "--keep", help="Keep the sandbox after the shell exits."),
    grace: int | None = typer.Option(
        None, "--grace", help="Seconds paused after the timeout before it is deleted."
    ),
    keepalive: int = typer.Option(
        0, "--keepalive", help="Kill it once no client touched it for this many seconds."
    ),
    capacity_wait: int | None = typer.Option(
        None,
        "--capacity-wait",
        help="Seconds the create may queue for capacity before a 503 (0: refuse at once).",
    ),
) -> None:
    """Create a sandbox and open an interactive shell in it (killed when the shell exits)."""

    def pairs(items: list[str], what: str) -> dict[str, str]:
        out = {}
        for item in items:
            k, sep, v = item.partition("=")
            if not sep or not k:
                raise ClientError(f"{what} takes KEY=VALUE, got {item!r}")
            out[k] = v
        return out

    def create() -> tuple[Api, dict[str, Any]]:
        api = _api()
        body = {
            "templateID": template,
            "timeout": timeout,
            "metadata": pairs(metadata or [], "--metadata"),
            "envVars": pairs(env or [], "--env"),
            "keepalive": keepalive,
        }
        if grace is not None:
            body["gracePeriod"] = grace
        wait = {}
        if capacity_wait is not None:
            body["capacityWait"] = capacity_wait
            # The create may queue that long before the node starts it.
            wait = {"timeout": httpx.Timeout(30.0, read=300.0 + capacity_wait)}
        return api, api.call("POST", "/v2/sandboxes", json=body, **wait).json()

    api, sbx = _guard(create)
    sid = sbx["sandboxID"]
    if detach:
        print(sid)
        return
    err.print(f"sandbox {sid} ({template}); exit the shell to {'leave' if keep else 'kill'} it")
    code = 1
    try:
        code = _guard(lambda: asyncio.run(shell(api.target, sid, sbx.get("envdAccessToken"))))
    finally:
        if not keep:
            with contextlib.suppress(ClientError, httpx.HTTPError):
                api.call("DELETE", f"/sandboxes/{sid}")
    raise typer.Exit(code)


@client_app.command()
def connect(sandbox_id: str) -> None:
    """Open an interactive shell in a running sandbox."""

    def run() -> int:
        api = _api()
        token = (
            api.call("POST", f"/v2/sandboxes/{sandbox_id}/connect", json={})
            .json()
            .get("envdAccessToken")
        )
        return asyncio.run(shell(api.target, sandbox_id, token))

    raise typer.Exit(_guard(run))


@client_app.command(
    "exec", context_settings={"allow_extra_args": True, "ignore_unknown_options": True}
)
def exec_(
    sandbox_id: str,
    command: Annotated[list[str], typer.Argument(help="Command and arguments (after --).")],
    user: str = typer.Option(None, "--user", "-u"),
    cwd: str = typer.Option(None, "--cwd"),
) -> None:
    """Run a command, stream its output and exit with its exit code."""

    def run() -> int:
        api = _api()
        token = api.sandbox(sandbox_id).get("envdAccessToken")
        return asyncio.run(exec_command(api.target, sandbox_id, token, command, user, cwd))

    raise typer.Exit(_guard(run))


@client_app.command()
def pause(sandbox_id: str) -> None:
    """Pause a sandbox (snapshot its memory and disk)."""
    _guard(lambda: _api().call("POST", f"/sandboxes/{sandbox_id}/pause", json={}))
    err.print(f"paused {sandbox_id}")


@client_app.command()
def resume(sandbox_id: str, timeout: int = typer.Option(300, "--timeout", "-t")) -> None:
    """Resume a paused sandbox."""
    _guard(
        lambda: _api().call(
            "POST", f"/v2/sandboxes/{sandbox_id}/connect", json={"timeout": timeout}
        )
    )
    err.print(f"resumed {sandbox_id}")


@client_app.command()
def fork(
    sandbox_id: str,
    count: int = typer.Option(1, "--count", "-n", help="how many children (1-100)"),
    timeout: int = typer.Option(300, "--timeout", "-t", help="children's lifetime in seconds"),
    snapshot: bool = typer.Option(
        False, "--snapshot", help="SANDBOX_ID names a persistent snapshot (id or name)."
    ),
) -> None:
    """Start COUNT sandboxes from one snapshot of a running sandbox (which keeps running) or
    of a paused one (which stays paused), or with --snapshot from a persistent snapshot, all
    or none."""
    if not 1 <= count <= 100:
        _fail("--count must be between 1 and 100")
    path = f"/snapshots/{sandbox_id}/fork" if snapshot else f"/sandboxes/{sandbox_id}/fork"
    resp = _guard(lambda: _api().call("POST", path, json={"count": count, "timeout": timeout}))
    rows = [entry["sandbox"] for entry in resp.json() if "sandbox" in entry]
    emit(rows, [("SANDBOX", "sandboxID"), ("TEMPLATE", "templateID")])
    err.print(f"forked {len(rows)} sandbox(es) from {sandbox_id}")


@client_app.command()
def reset(
    sandbox_id: str,
    snapshot: str | None = typer.Option(
        None, "--snapshot", help="a persistent snapshot to go back to (default: its template)"
    ),
) -> None:
    """Put a running sandbox back to the state it was created from, keeping its id."""
    body = {"snapshot": snapshot} if snapshot is not None else {}
    _guard(lambda: _api().call("POST", f"/sandboxes/{sandbox_id}/reset", json=body))
    err.print(f"reset {sandbox_id}")


@client_app.command("timeout")
def set_timeout(sandbox_id: str, seconds: int) -> None:
    """Make the sandbox expire SECONDS from now."""
    if seconds < 0:
        _fail("SECONDS must not be negative")
    _guard(
        lambda: _api().call("POST", f"/sandboxes/{sandbox_id}/timeout", json={"timeout": seconds})
    )
    err.print(f"{sandbox_id} now expires in {seconds} s")


@client_app.command()
def rm(sandbox_ids: list[str]) -> None:
    """Kill sandboxes."""

    def run() -> None:
        api = _api()
        for sid in sandbox_ids:
            api.call("DELETE", f"/sandboxes/{sid}")
            err.print(f"killed {sid}")

    _guard(run)


@client_app.command()
def logs(sandbox_id: str) -> None:
    """Show a sandbox's lifecycle log."""
    body = _guard(lambda: _api().call("GET", f"/v2/sandboxes/{sandbox_id}/logs").json())
    if not sys.stdout.isatty():
        json.dump(body["logs"], sys.stdout, indent=2)
        sys.stdout.write("\n")
        return
    for entry in body["logs"]:
        print(f"{entry['timestamp']}  {entry['level']:5}  {entry['message']}")


template_app.command("logs")(build.template_logs)
client_app.command("build")(build.build)
client_app.command("pull")(build.pull)

if __name__ == "__main__":
    client_app()
