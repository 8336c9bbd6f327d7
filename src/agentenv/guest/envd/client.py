"""A small async envd client for the host side: health, /init and running a command.

It speaks the Connect protocol by hand over httpx (JSON codec, envelope framing), so the
orchestrator and e2e tests can check a guest without the generated stubs.
"""

from __future__ import annotations

import asyncio
import base64
import json
import struct
import time
from collections.abc import AsyncIterator, Mapping
from types import TracebackType
from typing import Any, NamedTuple

import httpx

ENVD_PORT = 49983

_END_STREAM = 0x02
_HEADER = struct.Struct(">BI")


class EnvdError(Exception):
    """envd answered with a Connect or HTTP error."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class RunResult(NamedTuple):
    exit_code: int
    stdout: str
    stderr: str


def encode_envelope(message: Mapping[str, Any], flags: int = 0) -> bytes:
    body = json.dumps(message, separators=(",", ":")).encode()
    return _HEADER.pack(flags, len(body)) + body


async def iter_envelopes(chunks: AsyncIterator[bytes]) -> AsyncIterator[tuple[int, bytes]]:
    """Split a Connect streaming body into (flags, payload) pairs."""
    buf = bytearray()
    async for chunk in chunks:
        buf += chunk
        while len(buf) >= _HEADER.size:
            flags, size = _HEADER.unpack_from(buf)
            if len(buf) < _HEADER.size + size:
                break
            payload = bytes(buf[_HEADER.size : _HEADER.size + size])
            del buf[: _HEADER.size + size]
            yield flags, payload
    if buf:
        raise EnvdError("internal", f"stream ended inside an envelope ({len(buf)} bytes left)")


def basic_user(user: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:".encode()).decode()


class EnvdClient:
    """Talks to one envd (`base_url` like ``http://198.18.0.1:49983``)."""

    def __init__(
        self,
        base_url: str,
        access_token: str | None = None,
        *,
        timeout: float = 30.0,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        self.access_token = access_token
        base_headers = dict(headers or {})
        self._http = httpx.AsyncClient(
            base_url=base_url.rstrip("/"),
            timeout=httpx.Timeout(timeout),
            headers=base_headers,
        )

    async def __aenter__(self) -> EnvdClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    def _headers(self, user: str | None = None) -> dict[str, str]:
        headers: dict[str, str] = {}
        if self.access_token:
            headers["X-Access-Token"] = self.access_token
        if user:
            headers["Authorization"] = basic_user(user)
        return headers

    async def health(self) -> bool:
        """True when envd answers `/health` with a 2xx; False if it is not reachable."""
        try:
            response = await self._http.get("/health", timeout=5.0)
        except httpx.TransportError:
            return False
        return response.is_success

    async def wait_healthy(self, timeout: float = 30.0, interval: float = 0.1) -> None:  # noqa: ASYNC109
        """Polls `/health` until it answers, at most `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while not await self.health():
            if time.monotonic() >= deadline:
                raise TimeoutError(f"envd at {self._http.base_url} not healthy after {timeout}s")
            await asyncio.sleep(interval)

    async def init(
        self,
        *,
        env_vars: Mapping[str, str] | None = None,
        access_token: str | None = None,
        default_user: str | None = None,
        default_workdir: str | None = None,
        timestamp: float | None = None,
        hostname: str | None = None,
        entropy: bytes | None = None,
    ) -> None:
        """`POST /init`. `timestamp` defaults to now (the guest clock follows the host's).

        After setting `access_token`, this client uses it for every later call.
        """
        body: dict[str, Any] = {
            "timestamp": _rfc3339(time.time() if timestamp is None else timestamp)
        }
        if env_vars is not None:
            body["envVars"] = dict(env_vars)
        if access_token is not None:
            body["accessToken"] = access_token
        if default_user is not None:
            body["defaultUser"] = default_user
        if default_workdir is not None:
            body["defaultWorkdir"] = default_workdir
        if hostname is not None:
            body["hostname"] = hostname
        if entropy is not None:
            body["entropy"] = base64.b64encode(entropy).decode()
        response = await self._http.post("/init", json=body, headers=self._headers())
        _raise_for_http(response)
        if access_token is not None:
            self.access_token = access_token or None

    async def run(
        self,
        cmd: str,
        user: str | None = None,
        timeout: float = 60.0,  # noqa: ASYNC109 - it is the process's deadline, sent to envd
        *,
        envs: Mapping[str, str] | None = None,
        cwd: str | None = None,
        shell: str = "/bin/bash",
    ) -> RunResult:
        """Runs `cmd` through `shell -l -c` as the SDK does and waits for it to end."""
        process: dict[str, Any] = {"cmd": shell, "args": ["-l", "-c", cmd]}
        if envs:
            process["envs"] = dict(envs)
        if cwd:
            process["cwd"] = cwd
        request = {"process": process, "stdin": False}
        headers = self._headers(user)
        headers.update(
            {
                "Content-Type": "application/connect+json",
                "Connect-Protocol-Version": "1",
                "Connect-Timeout-Ms": str(int(timeout * 1000)),
            }
        )
        stdout, stderr = bytearray(), bytearray()
        end: dict[str, Any] | None = None
        async with self._http.stream(
            "POST",
            "/process.Process/Start",
            content=encode_envelope(request),
            headers=headers,
            timeout=httpx.Timeout(timeout + 5.0),
        ) as response:
            if response.status_code != 200:
                await response.aread()
                _raise_for_http(response)
            async for flags, payload in iter_envelopes(response.aiter_bytes()):
                message = json.loads(payload or b"{}")
                if flags & _END_STREAM:
                    if "error" in message:
                        err = message["error"]
                        raise EnvdError(
                            str(err.get("code", "unknown")), str(err.get("message", ""))
                        )
                    break
                event = message.get("event", {})
                if "data" in event:
                    data = event["data"]
                    if "stdout" in data:
                        stdout += base64.b64decode(data["stdout"])
                    elif "stderr" in data:
                        stderr += base64.b64decode(data["stderr"])
                    elif "pty" in data:
                        stdout += base64.b64decode(data["pty"])
                elif "end" in event:
                    end = event["end"]
        if end is None:
            raise EnvdError("internal", "process stream ended without an end event")
        return RunResult(
            int(end.get("exitCode", 0)),
            stdout.decode(errors="replace"),
            stderr.decode(errors="replace"),
        )


def _raise_for_http(response: httpx.Response) -> None:
    if response.is_success:
        return
    try:
        body = response.json()
    except ValueError:
        body = None
    if isinstance(body, dict) and "code" in body:
        raise EnvdError(str(body["code"]), str(body.get("message", "")))
    raise EnvdError(str(response.status_code), response.text[:200])


def _rfc3339(ts: float) -> str:
    whole, nanos = divmod(int(ts * 1e9), 1_000_000_000)
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(whole))
    return f"{stamp}.{nanos:09d}Z"
