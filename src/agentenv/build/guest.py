"""Talking to the build sandbox's envd: a command whose output arrives line by line, and a
raw file upload. The same Connect-JSON framing as `guest.envd.client`."""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import AsyncIterator, Callable, Mapping
from pathlib import Path
from typing import Any

import httpx

from agentenv.guest.envd.client import (
    EnvdError,
    basic_user,
    encode_envelope,
    iter_envelopes,
)

_END_STREAM = 0x02
# A line longer than this is cut into pieces so one chatty step cannot grow a log entry
# without bound.
MAX_LINE = 8192


class _Lines:
    """Splits a byte stream into text lines for `emit(line, stream)`."""

    def __init__(self, stream: str, emit: Callable[[str, str], None]) -> None:
        self.stream = stream
        self.emit = emit
        self.buf = bytearray()

    def feed(self, data: bytes) -> None:
        self.buf += data
        while True:
            nl = self.buf.find(b"\n")
            if nl < 0:
                break
            self._out(bytes(self.buf[:nl]))
            del self.buf[: nl + 1]
        while len(self.buf) > MAX_LINE:
            self._out(bytes(self.buf[:MAX_LINE]))
            del self.buf[:MAX_LINE]

    def close(self) -> None:
        if self.buf:
            self._out(bytes(self.buf))
            self.buf.clear()

    def _out(self, raw: bytes) -> None:
        self.emit(raw.decode(errors="replace").rstrip("\r"), self.stream)


def _headers(token: str | None, user: str | None) -> dict[str, str]:
    headers: dict[str, str] = {}
    if token:
        headers["X-Access-Token"] = token
    if user:
        headers["Authorization"] = basic_user(user)
    return headers


async def run_streamed(
    http: httpx.AsyncClient,
    envd_url: str,
    token: str | None,
    cmd: str,
    *,
    user: str,
    on_line: Callable[[str, str], None],
    envs: Mapping[str, str] | None = None,
    cwd: str | None = None,
    timeout_s: float = 3600.0,
) -> int:
    """Runs `cmd` with `/bin/sh -c` (images need not have bash) as `user`; every output line
    goes to `on_line(line, "stdout"|"stderr")` as it arrives. Returns the exit code."""
    process: dict[str, Any] = {"cmd": "/bin/sh", "args": ["-c", cmd]}
    if envs:
        process["envs"] = dict(envs)
    if cwd:
        process["cwd"] = cwd
    headers = _headers(token, user)
    headers.update(
        {
            "Content-Type": "application/connect+json",
            "Connect-Protocol-Version": "1",
            "Connect-Timeout-Ms": str(int(timeout_s * 1000)),
        }
    )
    out, err = _Lines("stdout", on_line), _Lines("stderr", on_line)
    end: dict[str, Any] | None = None
    async with asyncio.timeout(timeout_s + 10.0):
        async with http.stream(
            "POST",
            f"{envd_url}/process.Process/Start",
            content=encode_envelope({"process": process, "stdin": False}),
            headers=headers,
            timeout=httpx.Timeout(30.0, read=None),
        ) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode(errors="replace")
                raise EnvdError(str(response.status_code), body[:300])
            chunks: AsyncIterator[bytes] = response.aiter_bytes()
            async for flags, payload in iter_envelopes(chunks):
                message = json.loads(payload or b"{}")
                if flags & _END_STREAM:
                    if "error" in message:
                        e = message["error"]
                        raise EnvdError(str(e.get("code", "unknown")), str(e.get("message", "")))
                    break
                event = message.get("event", {})
                data = event.get("data")
                if data:
                    if "stdout" in data:
                        out.feed(base64.b64decode(data["stdout"]))
                    elif "stderr" in data:
                        err.feed(base64.b64decode(data["stderr"]))
                elif "end" in event:
                    end = event["end"]
    out.close()
    err.close()
    if end is None:
        raise EnvdError("internal", "the command's stream ended without an exit status")
    return int(end.get("exitCode", 0))


async def upload_file(
    http: httpx.AsyncClient, envd_url: str, token: str | None, local: Path, dest: str
) -> None:
    """Writes the host file `local` to `dest` in the guest (as root), streamed."""

    async def chunks() -> AsyncIterator[bytes]:
        with local.open("rb") as f:
            while block := await asyncio.to_thread(f.read, 1 << 20):
                yield block

    headers = _headers(token, "root")
    headers["Content-Type"] = "application/octet-stream"
    response = await http.post(
        f"{envd_url}/files",
        params={"path": dest, "username": "root"},
        content=chunks(),
        headers=headers,
        timeout=httpx.Timeout(600.0),
    )
    if not response.is_success:
        raise EnvdError(str(response.status_code), response.text[:300])
