"""`aenv` client commands: talk to an agentenv server over its E2B-compatible HTTP API.

Control-plane calls use the REST routes; commands and shells go through the server's proxy to
envd's Connect-RPC (``process.Process``), exactly the way the E2B SDK reaches a sandbox.
Every failure ends as one readable line on stderr and a non-zero exit code.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import shutil
import signal
import sys
import termios
import time
import tty
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Annotated, Any, TypeVar

import httpx
import typer
from rich.console import Console
from rich.table import Table

from agentenv.cli import build
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
from agentenv.config import ENVD_PORT, Settings
from agentenv.guest.envd.client import encode_envelope, iter_envelopes

client_app = typer.Typer(no_args_is_help=True, add_completion=False)
template_app = typer.Typer(help="Templates on the server.", no_args_is_help=True)
keys_app = typer.Typer(help="API keys of the local server (run on the server host).")
teams_app = typer.Typer(
    help="Teams of the local server and their limits (run on the server host).",
    no_args_is_help=True,
)
client_app.add_typer(template_app, name="template")
client_app.add_typer(keys_app, name="keys")
client_app.add_typer(teams_app, name="teams")

_END_STREAM = 0x02
T = TypeVar("T")


def _emit(rows: list[dict[str, Any]], columns: list[tuple[str, str]]) -> None:
    """A table for people, JSON for pipes."""
    if not sys.stdout.isatty():
        json.dump(rows, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return
    table = Table(*(title for title, _ in columns))
    for row in rows:
        table.add_row(*(_cell(row.get(key)) for _, key in columns))
    Console().print(table)


def _cell(value: Any) -> str:
    if isinstance(value, dict):
        return ", ".join(f"{k}={v}" for k, v in value.items())
    return "" if value is None else str(value)


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
    from agentenv.config import ConfigError

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
    _emit(
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
    _emit(rows, columns)


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
        }
        return api, api.call("POST", "/v2/sandboxes", json=body).json()

    api, sbx = _guard(create)
    sid = sbx["sandboxID"]
    if detach:
        print(sid)
        return
    err.print(f"sandbox {sid} ({template}); exit the shell to {'leave' if keep else 'kill'} it")
    code = 1
    try:
        code = _guard(lambda: asyncio.run(_shell(api.target, sid, sbx.get("envdAccessToken"))))
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
        return asyncio.run(_shell(api.target, sandbox_id, token))

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
        return asyncio.run(_exec(api.target, sandbox_id, token, command, user, cwd))

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
) -> None:
    """Start COUNT sandboxes from one snapshot of a running sandbox (which keeps running)."""
    if not 1 <= count <= 100:
        _fail("--count must be between 1 and 100")
    resp = _guard(
        lambda: _api().call(
            "POST", f"/sandboxes/{sandbox_id}/fork", json={"count": count, "timeout": timeout}
        )
    )
    rows = [entry["sandbox"] for entry in resp.json() if "sandbox" in entry]
    _emit(rows, [("SANDBOX", "sandboxID"), ("TEMPLATE", "templateID")])
    err.print(f"forked {len(rows)} sandbox(es) from {sandbox_id}")


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


# -- keys (server side) ----------------------------------------------------------------------


def _keyring_run(fn: Callable[[Any], Awaitable[T]]) -> T:
    """`fn(keyring)` on the server's store (its SQLite file, or etcd with `AGENTENV_ETCD`),
    opened for this one call and closed after it."""
    from agentenv.api.keys import KeyRing
    from agentenv.api.server import db_path
    from agentenv.control.backend import open_store

    settings = Settings.from_env()
    path = db_path(settings)
    if not settings.etcd_endpoints and not path.exists():
        raise ClientError(f"no server database at {path}: start `aenv serve` once first")

    async def run() -> T:
        store = open_store(settings, path)
        try:
            return await fn(KeyRing(store))
        finally:
            await store.close()

    return asyncio.run(run())


@keys_app.command("create")
def keys_create(
    name: str = typer.Argument("key"),
    team: Annotated[
        str, typer.Option("--team", help="The team (id or name) the key acts for.")
    ] = "default",
) -> None:
    """Create an API key of a team; it is printed once and only its hash is stored."""
    key, secret = _guard(lambda: _team_call(lambda ring: ring.create(name, team)))
    err.print(f"created key {key.id} ({name}, team {team}); store it now, it is not shown again:")
    print(secret)


@keys_app.command("ls")
def keys_ls() -> None:
    """List API keys (ids, prefixes and teams, never the keys)."""

    async def listed(ring: Any) -> list[dict[str, Any]]:
        names = {t.id: t.name for t in await ring.teams()}
        return [
            {
                "id": k.id,
                "name": k.name,
                "team": names.get(k.team_id, k.team_id),
                "prefix": k.prefix + "…",
                "created": time.strftime("%Y-%m-%d %H:%M", time.localtime(k.created_at)),
                "revoked": "yes" if k.revoked_at else "",
            }
            for k in await ring.list()
        ]

    rows = _guard(lambda: _keyring_run(listed))
    _emit(rows, [("ID", "id"), ("NAME", "name"), ("TEAM", "team"), ("PREFIX", "prefix"),
                 ("CREATED", "created"), ("REVOKED", "revoked")])  # fmt: skip


@keys_app.command("revoke")
def keys_revoke(key_id: str) -> None:
    """Revoke an API key; every request with it fails (401) from the next one on."""
    from agentenv.api.keys import UnknownKey

    def run() -> None:
        try:
            _keyring_run(lambda ring: ring.revoke(key_id))
        except UnknownKey as exc:
            raise ClientError(str(exc)) from exc

    _guard(run)
    err.print(f"revoked {key_id}")


# -- teams (server side) ---------------------------------------------------------------------


def _team_call(fn: Callable[[Any], Awaitable[T]]) -> T:
    """`fn(keyring)`, its refusals (unknown team, bad value) as one-line errors."""
    from agentenv.api.keys import TeamExists, UnknownTeam

    try:
        return _keyring_run(fn)
    except (UnknownTeam, TeamExists, ValueError) as exc:
        raise ClientError(str(exc)) from exc


def _limit(value: int) -> str:
    return str(value) if value > 0 else "none"


@teams_app.command("create")
def teams_create(name: str) -> None:
    """Create a team (no limits of its own until `aenv teams set-limits`)."""
    team = _guard(lambda: _team_call(lambda ring: ring.create_team(name)))
    err.print(f"created team {team.name} ({team.id}); add a key: aenv keys create --team {name}")


@teams_app.command("ls")
def teams_ls() -> None:
    """List teams and their limits."""

    async def listed(ring: Any) -> list[dict[str, Any]]:
        return [
            {
                "id": t.id,
                "name": t.name,
                "max_sandboxes": _limit(t.max_sandboxes),
                "creates_per_minute": _limit(t.creates_per_minute),
            }
            for t in await ring.teams()
        ]

    rows = _guard(lambda: _keyring_run(listed))
    _emit(rows, [("ID", "id"), ("NAME", "name"), ("MAX SANDBOXES", "max_sandboxes"),
                 ("CREATES/MIN", "creates_per_minute")])  # fmt: skip


@teams_app.command("set-limits")
def teams_set_limits(
    team: str,
    max_sandboxes: Annotated[
        int | None,
        typer.Option("--max-sandboxes", help="Sandboxes running at once (0 = no limit)."),
    ] = None,
    creates_per_minute: Annotated[
        int | None,
        typer.Option("--creates-per-minute", help="Create rate (0 = no limit)."),
    ] = None,
) -> None:
    """Set a team's limits; a running server applies them from its next request."""
    if max_sandboxes is None and creates_per_minute is None:
        _fail("give --max-sandboxes and/or --creates-per-minute")
    found = _guard(
        lambda: _team_call(
            lambda ring: ring.set_limits(
                team, max_sandboxes=max_sandboxes, creates_per_minute=creates_per_minute
            )
        )
    )
    err.print(
        f"team {found.name}: max sandboxes {_limit(found.max_sandboxes)}, creates per minute "
        f"{_limit(found.creates_per_minute)}"
    )


# -- envd over the proxy ---------------------------------------------------------------------


def _envd(target: Target, sandbox_id: str, token: str | None) -> httpx.AsyncClient:
    headers = {"e2b-sandbox-id": sandbox_id, "e2b-sandbox-port": str(ENVD_PORT)}
    if token:
        headers["X-Access-Token"] = token
    return httpx.AsyncClient(
        base_url=target.url,
        headers=headers,
        timeout=httpx.Timeout(30.0, read=None),
        trust_env=False,
    )


def _stream_headers(user: str | None) -> dict[str, str]:
    headers = {"Content-Type": "application/connect+json", "Connect-Protocol-Version": "1"}
    if user:
        headers["Authorization"] = "Basic " + base64.b64encode(f"{user}:".encode()).decode()
    return headers


async def _unary(http: httpx.AsyncClient, method: str, body: dict[str, Any]) -> None:
    resp = await http.post(
        f"/process.Process/{method}",
        json=body,
        headers={"Connect-Protocol-Version": "1"},
    )
    if resp.status_code != 200:
        raise ClientError(f"{method}: {_rpc_message(resp)}")


def _rpc_message(resp: httpx.Response) -> str:
    try:
        body = resp.json()
        return f"{body.get('code')}: {body.get('message')}"
    except ValueError:
        return f"HTTP {resp.status_code}"


async def _run_stream(
    http: httpx.AsyncClient,
    request: dict[str, Any],
    user: str | None,
    on_start: Callable[[int], Any],
    on_data: Callable[[str, bytes], None],
) -> int:
    """Start a process and relay its events; returns its exit code."""
    async with http.stream(
        "POST",
        "/process.Process/Start",
        content=encode_envelope(request),
        headers=_stream_headers(user),
    ) as resp:
        if resp.status_code != 200:
            await resp.aread()
            raise ClientError(_rpc_message(resp))
        async for flags, payload in iter_envelopes(resp.aiter_bytes()):
            message = json.loads(payload or b"{}")
            if flags & _END_STREAM:
                if "error" in message:
                    raise ClientError(str(message["error"].get("message", message["error"])))
                break
            event = message.get("event", {})
            if "start" in event:
                res = on_start(int(event["start"]["pid"]))
                if asyncio.iscoroutine(res):
                    await res
            elif "data" in event:
                for stream, b64 in event["data"].items():
                    on_data(stream, base64.b64decode(b64))
            elif "end" in event:
                end = event["end"]
                code = int(end.get("exitCode", 0))
                # Killed by a signal: report it the way a shell does.
                return code if end.get("exited", True) or code >= 0 else 137
    raise ClientError("the command's stream ended without an exit status")


async def _exec(
    target: Target,
    sandbox_id: str,
    token: str | None,
    command: list[str],
    user: str | None,
    cwd: str | None,
) -> int:
    import shlex

    process: dict[str, Any] = {"cmd": "/bin/bash", "args": ["-l", "-c", shlex.join(command)]}
    if cwd:
        process["cwd"] = cwd
    out, errs = sys.stdout.buffer, sys.stderr.buffer

    def on_data(stream: str, data: bytes) -> None:
        sink = errs if stream == "stderr" else out
        sink.write(data)
        sink.flush()

    async with _envd(target, sandbox_id, token) as http:
        return await _run_stream(
            http, {"process": process, "stdin": False}, user, lambda _pid: None, on_data
        )


def _terminal_size(fd: int) -> tuple[int, int]:
    # The terminal itself, not $COLUMNS/$LINES, which may be stale copies from another shell.
    try:
        size = os.get_terminal_size(fd)
        return size.columns, size.lines
    except OSError:
        cols, rows = shutil.get_terminal_size((80, 24))
        return cols, rows


@contextlib.contextmanager
def _raw_terminal(fd: int) -> Iterator[None]:
    if not os.isatty(fd):
        yield
        return
    saved = termios.tcgetattr(fd)
    try:
        tty.setraw(fd)
        yield
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


async def _shell(target: Target, sandbox_id: str, token: str | None) -> int:
    """An interactive login shell on envd's PTY, with keystrokes and resizes forwarded."""
    stdin_fd = sys.stdin.fileno()
    cols, rows = _terminal_size(stdin_fd)
    request = {
        "process": {
            "cmd": "/bin/bash",
            "args": ["-i", "-l"],
            "envs": {"TERM": os.environ.get("TERM", "xterm-256color"), "LANG": "C.UTF-8"},
        },
        "pty": {"size": {"cols": cols, "rows": rows}},
    }
    loop = asyncio.get_running_loop()
    keys: asyncio.Queue[bytes | None] = asyncio.Queue()
    tasks: list[asyncio.Task[None]] = []
    out = sys.stdout.buffer

    async with _envd(target, sandbox_id, token) as http:

        async def forward_keys(pid: int) -> None:
            while (data := await keys.get()) is not None:
                # Coalesce what piled up so fast typing costs one request.
                while not keys.empty():
                    more = keys.get_nowait()
                    if more is None:
                        return
                    data += more
                body = {"process": {"pid": pid}, "input": {"pty": base64.b64encode(data).decode()}}
                await _unary(http, "SendInput", body)

        def on_key() -> None:
            try:
                data = os.read(stdin_fd, 4096)
            except OSError:
                data = b""
            keys.put_nowait(data or None)
            if not data:
                loop.remove_reader(stdin_fd)

        def on_start(pid: int) -> None:
            tasks.append(asyncio.create_task(forward_keys(pid)))
            loop.add_reader(stdin_fd, on_key)

            def resized() -> None:
                c, r = _terminal_size(stdin_fd)
                body = {"process": {"pid": pid}, "pty": {"size": {"cols": c, "rows": r}}}
                tasks.append(asyncio.create_task(_unary(http, "Update", body)))

            loop.add_signal_handler(signal.SIGWINCH, resized)

        def on_data(_stream: str, data: bytes) -> None:
            out.write(data)
            out.flush()

        with _raw_terminal(stdin_fd):
            try:
                return await _run_stream(http, request, None, on_start, on_data)
            finally:
                with contextlib.suppress(ValueError, OSError):
                    loop.remove_reader(stdin_fd)
                loop.remove_signal_handler(signal.SIGWINCH)
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)


template_app.command("logs")(build.template_logs)
client_app.command("build")(build.build)
client_app.command("pull")(build.pull)

if __name__ == "__main__":
    client_app()
