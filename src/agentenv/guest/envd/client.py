"""The one host-side envd client: health, /init, metrics, running a command (whole or line
by line), uploading a file. The node (create, resume, fork, pauses that sync the disk), the
template builder and the e2e tests all use it.

It speaks the Connect protocol by hand (JSON codec, envelope framing), so the host needs no
generated stubs to drive a guest, over the host's HTTP/1.1 client (`agentenv.http1`: one
kept-alive connection serves a restore's health wait, identity and init). Every failure
leaves it as an `EnvdError` (the transport's errors are mapped once, in `_mapped`): callers
catch one type, never the transport's.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import functools
import json
import secrets
import ssl
import struct
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any, NamedTuple
from urllib.parse import quote, urlencode, urlsplit

from agentenv.http1 import Broken, Exchange, Reply, Unreachable, UpstreamPool, fetch, request_head

_END_STREAM = 0x02
UPLOAD_TIMEOUT_S = 600.0
_HEADER = struct.Struct(">BI")


class EnvdError(Exception):
    """envd answered with a Connect or HTTP error, or could not be asked (the subclasses)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class EnvdUnreachable(EnvdError):
    """No answer: the connection was refused, reset or cut (the guest is gone or not up)."""

    def __init__(self, message: str) -> None:
        super().__init__("unavailable", message)


class EnvdTimeout(EnvdError, TimeoutError):
    """envd did not answer (or become healthy) within the deadline."""

    def __init__(self, message: str) -> None:
        super().__init__("deadline_exceeded", message)


@contextlib.contextmanager
def _mapped(what: str) -> Iterator[None]:
    """The one place the transport's errors become ours."""
    try:
        yield
    except EnvdError:
        raise
    except TimeoutError as exc:
        raise EnvdTimeout(f"{what}: no answer in time") from exc
    except (Unreachable, Broken) as exc:
        raise EnvdUnreachable(f"{what}: {type(exc).__name__}: {exc}") from exc


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


def basic_user(user: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:".encode()).decode()


@functools.cache
def _tls() -> ssl.SSLContext:
    """One TLS context for every client, built on first use (loading the CA bundle costs ~20
    ms of CPU: per client, it was a third of the server's CPU per create). envd speaks plain
    http; the context serves only an https base URL."""
    return ssl.create_default_context()


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
        self._base = base_url.rstrip("/")
        url = urlsplit(self._base)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ValueError(f"envd URL {base_url!r}: expected http(s)://HOST[:PORT][/PATH]")
        self._prefix = url.path
        self._timeout = timeout
        self._fixed = [(b"host", url.netloc.encode("latin-1"))] + [
            (k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in (headers or {}).items()
        ]
        # Never through a proxy from the environment: a guest is reached at its slot address.
        https = url.scheme == "https"
        self._pool = UpstreamPool(
            functools.partial(
                asyncio.open_connection,
                url.hostname,
                url.port or (443 if https else 80),
                ssl=_tls() if https else None,
            )
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
        await self._pool.aclose()

    def _request(
        self,
        method: str,
        path: str,
        headers: Mapping[str, str],
        *,
        params: Mapping[str, str] | None = None,
        length: int | None = None,
    ) -> bytes:
        """A request's head (`length`: its body's, None for none)."""
        target = self._prefix + path
        if params:
            target += "?" + urlencode(params, quote_via=quote)
        fields = list(self._fixed)
        fields += [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]
        if length is not None:
            fields.append((b"content-length", str(length).encode()))
        return bytes(request_head(method, target, fields))

    async def _call(
        self,
        method: str,
        path: str,
        headers: Mapping[str, str],
        *,
        params: Mapping[str, str] | None = None,
        body: bytes | None = None,
        timeout_s: float | None = None,
    ) -> Reply:
        """One request and its whole answer, within `timeout_s` (the client's by default)."""
        head = self._request(
            method, path, headers, params=params, length=None if body is None else len(body)
        )
        async with asyncio.timeout(self._timeout if timeout_s is None else timeout_s):
            return await fetch(self._pool, head + (body or b""))

    @contextlib.asynccontextmanager
    async def _stream(
        self, path: str, body: bytes, headers: Mapping[str, str]
    ) -> AsyncIterator[Exchange]:
        """A POST whose answer is read as it comes (`Exchange.body`)."""
        exchange = await self._pool.exchange(
            self._request("POST", path, headers, length=len(body)) + body
        )
        try:
            await exchange.response()
            yield exchange
        finally:
            exchange.release()

    def _headers(self, user: str | None = None) -> dict[str, str]:
        headers: dict[str, str] = {}
        if self.access_token:
            headers["X-Access-Token"] = self.access_token
        if user:
            headers["Authorization"] = basic_user(user)
        return headers

    async def health(self) -> bool:
        """True when envd answers `/health` with a 2xx; False if it is not reachable."""
        return await self.unhealthy(5.0) is None

    async def unhealthy(self, timeout_s: float) -> str | None:
        """Why envd does not answer `/health` within `timeout_s` (a 2xx), None when it does."""
        try:
            with _mapped("/health"):
                response = await self._call("GET", "/health", {}, timeout_s=timeout_s)
        except EnvdTimeout:
            return f"no answer in {timeout_s:g} s"
        except EnvdError as exc:
            return exc.message
        if not 200 <= response.status < 300:
            return f"/health answered {response.status}"
        return None

    async def metrics(self) -> dict[str, Any] | None:
        """envd's `/metrics` sample (a JSON object), None if it answered something else."""
        with _mapped("/metrics"):
            response = await self._call("GET", "/metrics", self._headers())
        _raise_for_http(response)
        try:
            body = json.loads(response.content)
        except ValueError:
            return None
        return body if isinstance(body, dict) else None

    async def wait_healthy(
        self,
        timeout: float = 30.0,  # noqa: ASYNC109 - polled against, each request bounded by `probe_s`
        interval: float = 0.1,
        *,
        probe_s: float = 2.0,
        gone: Callable[[], str | None] | None = None,
    ) -> None:
        """The one health wait: polls `/health` until it answers, at most `timeout` seconds.
        `gone()` says why waiting is pointless (e.g. the VM exited); it is asked before every
        probe and ends the wait with `EnvdUnreachable`. Raises `EnvdTimeout` naming the last
        reason otherwise."""
        deadline = time.monotonic() + timeout
        last = "no answer"
        while True:
            if gone is not None and (why := gone()) is not None:
                raise EnvdUnreachable(why)
            reason = await self.unhealthy(max(0.1, min(probe_s, deadline - time.monotonic())))
            if reason is None:
                return
            last = reason
            if time.monotonic() >= deadline:
                raise EnvdTimeout(f"envd at {self._base} not healthy after {timeout:g}s ({last})")
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
        headers = self._headers()
        headers["Content-Type"] = "application/json"
        with _mapped("/init"):
            response = await self._call(
                "POST", "/init", headers, body=json.dumps(body, separators=(",", ":")).encode()
            )
        _raise_for_http(response)
        if access_token is not None:
            self.access_token = access_token or None

    async def run_streamed(
        self,
        cmd: str,
        *,
        user: str,
        on_line: Callable[[str, str], None],
        envs: Mapping[str, str] | None = None,
        cwd: str | None = None,
        timeout_s: float = 3600.0,
    ) -> int:
        """Runs `cmd` with `/bin/sh -c` (images need not have bash) as `user`; every output
        line goes to `on_line(line, "stdout"|"stderr")` as it arrives. Returns the exit code."""
        process: dict[str, Any] = {"cmd": "/bin/sh", "args": ["-c", cmd]}
        if envs:
            process["envs"] = dict(envs)
        if cwd:
            process["cwd"] = cwd
        headers = self._headers(user)
        headers.update(
            {
                "Content-Type": "application/connect+json",
                "Connect-Protocol-Version": "1",
                "Connect-Timeout-Ms": str(int(timeout_s * 1000)),
            }
        )
        out, err = _Lines("stdout", on_line), _Lines("stderr", on_line)
        end: dict[str, Any] | None = None
        with _mapped("process.Start"):
            end = await self._stream_lines(process, headers, out, err, timeout_s)
        out.close()
        err.close()
        if end is None:
            raise EnvdError("internal", "the command's stream ended without an exit status")
        return int(end.get("exitCode", 0))

    async def _stream_lines(
        self,
        process: dict[str, Any],
        headers: dict[str, str],
        out: _Lines,
        err: _Lines,
        timeout_s: float,
    ) -> dict[str, Any] | None:
        end: dict[str, Any] | None = None
        async with (
            asyncio.timeout(timeout_s + 10.0),
            self._stream(
                "/process.Process/Start",
                encode_envelope({"process": process, "stdin": False}),
                headers,
            ) as response,
        ):
            if response.status != 200:
                body = b"".join([chunk async for chunk in response.body()])
                raise EnvdError(str(response.status), body.decode(errors="replace")[:300])
            async for flags, payload in iter_envelopes(response.body()):
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
        return end

    async def write_file(self, path: str, data: bytes, user: str) -> None:
        """Writes `data` to `path` as `user`, as the SDK's `files.write` does (multipart)."""
        headers = self._headers(user)
        body, headers["Content-Type"] = _multipart(path.rsplit("/", 1)[-1], data)
        with _mapped("files.write"):
            response = await self._call("POST", "/files", headers, params={"path": path}, body=body)
        _raise_for_http(response)

    async def read_file(self, path: str, user: str) -> bytes:
        """The file at `path`, read as `user` (the SDK's `files.read`)."""
        with _mapped("files.read"):
            response = await self._call("GET", "/files", self._headers(user), params={"path": path})
        _raise_for_http(response)
        return response.content

    async def upload_file(self, local: Path, dest: str) -> None:
        """Writes the host file `local` to `dest` in the guest (as root), streamed."""

        async def chunks() -> AsyncIterator[bytes]:
            with local.open("rb") as f:
                while block := await asyncio.to_thread(f.read, 1 << 20):
                    yield block

        headers = self._headers("root")
        headers["Content-Type"] = "application/octet-stream"
        size = (await asyncio.to_thread(local.stat)).st_size
        head = self._request(
            "POST", "/files", headers, params={"path": dest, "username": "root"}, length=size
        )
        with _mapped("upload"):
            async with asyncio.timeout(UPLOAD_TIMEOUT_S):
                exchange = await self._pool.exchange(head, replayable=False)
                try:
                    await exchange.send_body(chunks(), chunked=False)
                    await exchange.response()
                    content = b"".join([chunk async for chunk in exchange.body()])
                finally:
                    exchange.release()
        if not 200 <= exchange.status < 300:
            raise EnvdError(str(exchange.status), content.decode(errors="replace")[:300])

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
        with _mapped("process.Start"):
            end = await self._collect(request, headers, timeout, stdout, stderr)
        if end is None:
            raise EnvdError("internal", "process stream ended without an end event")
        return RunResult(
            int(end.get("exitCode", 0)),
            stdout.decode(errors="replace"),
            stderr.decode(errors="replace"),
        )

    async def _collect(
        self,
        request: dict[str, Any],
        headers: dict[str, str],
        timeout: float,  # noqa: ASYNC109 - the process's deadline, sent to envd
        stdout: bytearray,
        stderr: bytearray,
    ) -> dict[str, Any] | None:
        end: dict[str, Any] | None = None
        async with (
            asyncio.timeout(timeout + 5.0),
            self._stream("/process.Process/Start", encode_envelope(request), headers) as response,
        ):
            if response.status != 200:
                content = b"".join([chunk async for chunk in response.body()])
                _raise_for_http(Reply(response.status, response.headers, content))
            async for flags, payload in iter_envelopes(response.body()):
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
        return end


def _raise_for_http(response: Reply) -> None:
    if 200 <= response.status < 300:
        return
    try:
        body = json.loads(response.content)
    except ValueError:
        body = None
    if isinstance(body, dict) and "code" in body:
        raise EnvdError(str(body["code"]), str(body.get("message", "")))
    raise EnvdError(str(response.status), response.content.decode(errors="replace")[:200])


def _multipart(filename: str, data: bytes) -> tuple[bytes, str]:
    """A `multipart/form-data` body with one part, `file` (what the SDKs' `files.write`
    sends), and its Content-Type."""
    boundary = secrets.token_hex(16)
    name = (
        filename.replace("\\", "\\\\").replace('"', "%22").replace("\r", "%0D").replace("\n", "%0A")
    )
    body = (
        (
            f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="{name}"\r\n'
            "Content-Type: application/octet-stream\r\n\r\n"
        ).encode()
        + data
        + f"\r\n--{boundary}--\r\n".encode()
    )
    return body, f"multipart/form-data; boundary={boundary}"


def _rfc3339(ts: float) -> str:
    whole, nanos = divmod(int(ts * 1e9), 1_000_000_000)
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(whole))
    return f"{stamp}.{nanos:09d}Z"
