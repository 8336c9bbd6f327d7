"""Commands and shells in a sandbox from the CLI: envd's `process.Process` Connect-RPC over
the server's proxy, as the E2B SDK reaches it (a server stream of output, unary input and
resize; the local terminal in raw mode for a shell). Split from `client.py`."""

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
import tty
from collections.abc import Callable, Iterator
from typing import Any

import httpx

from agentenv.cli.connection import ClientError, Target
from agentenv.guest.envd.client import encode_envelope, iter_envelopes
from agentenv.ports import ENVD_PORT

_END_STREAM = 0x02


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


async def exec_command(
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


async def shell(target: Target, sandbox_id: str, token: str | None) -> int:
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
