"""A sandbox killed while one of its envd streams or a WebSocket to it is open, as E2B's
proxy answers it: a Connect stream cut between frames ends with an `unavailable` error frame
("the connection to sandbox ... ended before the stream completed"), one cut mid-frame and
any other body has its connection dropped, a WebSocket is dropped without a close frame. The
official Python SDK raises its "killed" error; the JS SDK (node) its TimeoutError. A reset
ends them saying so; a request that comes while the sandbox is between states waits for it.

No VM: a loopback server stands in for envd (a `Start` stream that sends its start event and
then stays open, and `/health`), the proxy serves through uvicorn next to a stub of the
connect route, and the kill is what the manager does: the record leaves RUNNING, then
`SandboxProxy.drop`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import shutil
import struct
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import uvicorn
import websockets
from e2b import Sandbox
from e2b.exceptions import SandboxNotRunningException
from e2e.jsdeps import JS_DIR, ensure_js_sdk

from agentenv.control.metrics import Metrics
from agentenv.control.store import SandboxRecord, SandboxState
from agentenv.ports import ENVD_PORT
from agentenv.proxy.cuts import EnvelopeTracker
from agentenv.proxy.forward import SandboxProxy
from agentenv.proxy.routing import Sandbox as Target

SANDBOX_ID = "icutstream0000000000"
PID = 7
# Every step here is local and takes milliseconds; the bound only turns a hang into a failure.
STEP_S = 20.0
# How long the stand-in envd keeps a stream open when nobody cuts it.
OPEN_S = 60.0
# A command the stand-in answers with its start event and half of the next frame.
HALF_FRAME = "sleep 61"
RESET_WHY = f"sandbox {SANDBOX_ID} was reset"
# A Connect call to the sandbox's envd through the proxy.
CONNECT_HEADERS = {
    "e2b-sandbox-id": SANDBOX_ID,
    "e2b-sandbox-port": str(ENVD_PORT),
    "content-type": "application/connect+json",
    "connect-protocol-version": "1",
}


def _envelope(flags: int, message: dict[str, Any]) -> bytes:
    data = json.dumps(message).encode()
    return struct.pack(">BI", flags, len(data)) + data


async def _envd(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """`Start` answers its start event and then nothing (a `sleep 60`); `/health` is 204; a
    WebSocket is accepted, greeted with `hello` and then left open."""
    if scope["type"] == "websocket":
        await receive()
        await send({"type": "websocket.accept"})
        await send({"type": "websocket.send", "text": "hello"})
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(OPEN_S):
                while (await receive())["type"] != "websocket.disconnect":
                    pass
        return
    if scope["type"] != "http":
        return
    if scope["path"] == "/health":
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})
        return
    request = b""
    while True:
        msg = await receive()
        request += msg.get("body", b"")
        if not msg.get("more_body"):
            break
    headers = [(b"content-type", b"application/connect+json")]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    start = _envelope(0, {"event": {"start": {"pid": PID}}})
    if HALF_FRAME.encode() in request:
        # The start event and the first bytes of the next frame: cut mid-frame.
        start += _envelope(0, {"event": {"data": {"stdout": "aGk="}}})[:7]
    await send({"type": "http.response.body", "body": start, "more_body": True})
    # Open until the proxy goes away (its pool closed by the drop) or OPEN_S.
    try:
        async with asyncio.timeout(OPEN_S):
            while (await receive())["type"] != "http.disconnect":
                pass
    except TimeoutError:
        end = _envelope(0, {"event": {"end": {"exitCode": 0, "exited": True}}})
        await send({"type": "http.response.body", "body": end + _envelope(2, {})})


async def _serve(
    app: Any, host: str = "127.0.0.1", port: int = 0
) -> tuple[uvicorn.Server, asyncio.Task[None], int]:
    # The server's own WebSocket implementation (api/server.py).
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level="warning",
        lifespan="off",
        ws="websockets-sansio",
    )
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    async with asyncio.timeout(STEP_S):
        while not server.started:  # noqa: ASYNC110
            await asyncio.sleep(0.02)
    return server, task, server.servers[0].sockets[0].getsockname()[1]


@dataclass
class Setup:
    url: str
    records: dict[str, SandboxRecord]
    proxy: SandboxProxy

    async def kill(self) -> None:
        """The manager's kill as the proxy sees it: not running any more, then released."""
        rec = self.records[SANDBOX_ID]
        self.records[SANDBOX_ID] = dataclasses.replace(rec, state=SandboxState.GONE)
        await self.proxy.drop(SANDBOX_ID)

    async def reset(self) -> None:
        """The manager's reset as the proxy sees it: it stays running, released with why."""
        await self.proxy.drop(SANDBOX_ID, RESET_WHY)


@pytest.fixture
async def setup() -> AsyncIterator[Setup]:
    envd, envd_task, envd_port = await _serve(_envd)
    now = time.time()
    rec = SandboxRecord(
        id=SANDBOX_ID, template="base", alias="base", state=SandboxState.RUNNING,
        started_at=now, end_at=now + 600, cpu=1, memory_mb=512, disk_mb=1024,
        envd_version="0.6.4", address="127.0.0.1",
    )  # fmt: skip
    records = {SANDBOX_ID: rec}

    async def resolve(sandbox_id: str) -> SandboxRecord | None:
        return records.get(sandbox_id)

    proxy = SandboxProxy(resolve, Metrics())

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "websocket":
            await proxy.websocket(scope, receive, send, Target(SANDBOX_ID, envd_port, "/"))
            return
        if scope["type"] != "http":
            return
        headers = {k.decode(): v.decode() for k, v in scope["headers"]}
        if "e2b-sandbox-id" in headers:
            # envd's port is the stand-in's.
            port = int(headers.get("e2b-sandbox-port", ENVD_PORT))
            target = Target(headers["e2b-sandbox-id"], envd_port if port == ENVD_PORT else port,
                            scope["path"])  # fmt: skip
            await proxy.http(scope, receive, send, target)
            return
        # The control plane's connect, all the SDK asks of it here.
        body = json.dumps({"templateID": "base", "sandboxID": SANDBOX_ID, "clientID": "test",
                           "envdVersion": "0.6.4"}).encode()  # fmt: skip
        while (await receive()).get("more_body"):
            pass
        hdrs = [(b"content-type", b"application/json")]
        await send({"type": "http.response.start", "status": 200, "headers": hdrs})
        await send({"type": "http.response.body", "body": body})

    front, front_task, front_port = await _serve(app)
    try:
        yield Setup(f"http://127.0.0.1:{front_port}", records, proxy)
    finally:
        await proxy.close()
        for server, task in ((front, front_task), (envd, envd_task)):
            server.should_exit = True
            await task


def _start_body(command: str = "sleep 60") -> bytes:
    return _envelope(0, {"process": {"cmd": "/bin/bash", "args": ["-l", "-c", command]}})


def _frames(data: bytes) -> list[tuple[int, bytes]]:
    out = []
    while data:
        flags, size = struct.unpack(">BI", data[:5])
        assert len(data) >= 5 + size, f"cut frame: {data!r}"
        out.append((flags, data[5 : 5 + size]))
        data = data[5 + size :]
    return out


def test_envelope_tracker_finds_frame_boundaries() -> None:
    one, two = _envelope(0, {"a": 1}), _envelope(0, {})
    empty = b"\x00\x00\x00\x00\x00"
    for writes, boundary in [
        ([], True),
        ([one], True),
        ([one + two], True),
        ([empty], True),
        ([one[:3]], False),
        ([one[:5]], False),
        ([one[:7]], False),
        ([one[:3], one[3:]], True),
        ([one, two[:6]], False),
        ([one[:2], one[2:] + two[:1], two[1:]], True),
    ]:
        tracker = EnvelopeTracker()
        for chunk in writes:
            tracker.advance(chunk)
        assert tracker.at_boundary is boundary, writes


async def test_a_killed_sandbox_ends_the_open_stream_with_unavailable(setup: Setup) -> None:
    """As E2B's proxy: a Connect stream cut between frames gets an end-of-stream frame with
    an `unavailable` error naming the sandbox (what the SDKs' "killed" handling expects),
    and `/health` answers the 502 "was not found" they probe with."""
    headers = CONNECT_HEADERS
    async with httpx.AsyncClient(base_url=setup.url, timeout=STEP_S) as client:
        async with client.stream(
            "POST", "/process.Process/Start", content=_start_body(), headers=headers
        ) as resp:
            assert resp.status_code == 200
            chunks = resp.aiter_raw()
            got = await anext(chunks)
            assert b'"start"' in got
            await setup.kill()
            rest = b""
            async with asyncio.timeout(STEP_S):
                async for chunk in chunks:
                    rest += chunk
        frames = _frames(rest)
        assert [flags for flags, _ in frames] == [2], frames
        error = json.loads(frames[0][1])["error"]
        assert error == {
            "code": "unavailable",
            "message": f"the connection to sandbox {SANDBOX_ID} ended before the stream completed",
        }
        health = await client.get("/health", headers=headers)
        assert health.status_code == 502
        assert "was not found" in health.json()["message"]


async def test_a_reset_ends_the_open_stream_and_websocket_cleanly_saying_so(setup: Setup) -> None:
    """A reset (#24): the sandbox lives on, so its clients are told why their stream ended: a
    Connect stream gets an `unavailable` end frame with the reason, a WebSocket a clean close
    1012 ("service restart") with it, not the dropped connection of a stopped sandbox."""
    headers = CONNECT_HEADERS
    url = setup.url.replace("http://", "ws://") + "/"
    async with asyncio.timeout(STEP_S):
        ws = await websockets.connect(url, open_timeout=STEP_S, close_timeout=1)
    try:
        async with asyncio.timeout(STEP_S):
            assert await ws.recv() == "hello"
        async with (
            httpx.AsyncClient(base_url=setup.url, timeout=STEP_S) as client,
            client.stream(
                "POST", "/process.Process/Start", content=_start_body(), headers=headers
            ) as resp,
        ):
            chunks = resp.aiter_raw()
            assert b'"start"' in await anext(chunks)
            await setup.reset()
            rest = b""
            async with asyncio.timeout(STEP_S):
                async for chunk in chunks:
                    rest += chunk
        frames = _frames(rest)
        assert [flags for flags, _ in frames] == [2], frames
        assert json.loads(frames[0][1])["error"] == {"code": "unavailable", "message": RESET_WHY}
        with pytest.raises(websockets.ConnectionClosed) as caught:
            async with asyncio.timeout(STEP_S):
                await ws.recv()
        assert caught.value.rcvd is not None, "no close frame"
        assert (caught.value.rcvd.code, caught.value.rcvd.reason) == (1012, RESET_WHY)
    finally:
        await ws.close()


async def test_a_request_during_a_reset_waits_for_the_new_guest(setup: Setup) -> None:
    """A request or WebSocket that comes while its sandbox is between states (a reset or
    resume loading its guest) is held until the sandbox runs again and then forwarded: it is
    not the 502 "was not found" the SDKs raise as a killed sandbox."""
    rec = setup.records[SANDBOX_ID]
    setup.records[SANDBOX_ID] = dataclasses.replace(rec, state=SandboxState.RESUMING)
    held_s = 0.3

    async def settle() -> None:
        await asyncio.sleep(held_s)
        setup.records[SANDBOX_ID] = rec

    url = setup.url.replace("http://", "ws://") + "/"
    async with asyncio.timeout(STEP_S), httpx.AsyncClient(base_url=setup.url) as client:
        t0 = time.monotonic()
        settling = asyncio.create_task(settle())
        health, ws = await asyncio.gather(
            client.get("/health", headers=CONNECT_HEADERS),
            websockets.connect(url, close_timeout=1),
        )
        await settling
        waited = time.monotonic() - t0
        try:
            assert await ws.recv() == "hello"
        finally:
            await ws.close()
    assert health.status_code == 204, health.text
    assert waited >= held_s


async def test_a_sandbox_still_between_states_after_the_wait_is_a_503(setup: Setup) -> None:
    """Past the wait a request gets a 503 saying which transition is under way, with
    Retry-After (the sandbox is there; the client may try again), a WebSocket the same."""
    rec = setup.records[SANDBOX_ID]
    # A pause waits only where traffic would resume the sandbox after it (auto-resume).
    setup.records[SANDBOX_ID] = dataclasses.replace(
        rec, state=SandboxState.PAUSING, auto_resume=True
    )
    setup.proxy._settle_wait_s = 0.2
    url = setup.url.replace("http://", "ws://") + "/"
    async with asyncio.timeout(STEP_S), httpx.AsyncClient(base_url=setup.url) as client:
        health = await client.get("/health", headers=CONNECT_HEADERS)
        with pytest.raises(websockets.InvalidStatus) as refused:
            await websockets.connect(url)
    assert health.status_code == 503
    assert health.headers["retry-after"] == "1"
    assert health.json() == {
        "code": 503,
        "message": f"sandbox {SANDBOX_ID} is still pausing after 0.2s "
        "(a reset, pause or resume under way); retry",
    }
    assert refused.value.response.status_code == 503


async def test_a_request_during_a_pause_without_auto_resume_is_refused_at_once(
    setup: Setup,
) -> None:
    """Waiting would end in the same 502 "was not found". An SDK's health probe after a
    stream the pause cut gives up after 5 s: a wait past that made the SDK raise "could not
    be reached" (seen under load in test_mixed_load) instead of its "not running" error."""
    rec = setup.records[SANDBOX_ID]
    setup.records[SANDBOX_ID] = dataclasses.replace(rec, state=SandboxState.PAUSING)
    assert not rec.auto_resume
    async with asyncio.timeout(STEP_S), httpx.AsyncClient(base_url=setup.url) as client:
        t0 = time.monotonic()
        health = await client.get("/health", headers=CONNECT_HEADERS)
        took = time.monotonic() - t0
    assert health.status_code == 502, health.text
    assert "was not found" in health.json()["message"]
    assert took < 1.0, "it waited for the pause"


async def test_a_stream_cut_mid_frame_is_dropped(setup: Setup) -> None:
    """A frame cannot be finished without inventing bytes: the connection is dropped with
    the chunked body unfinished (a clean end would read as a stream without its end)."""
    headers = CONNECT_HEADERS
    body = _start_body(HALF_FRAME)
    async with (
        httpx.AsyncClient(base_url=setup.url, timeout=STEP_S) as client,
        client.stream("POST", "/process.Process/Start", content=body, headers=headers) as resp,
    ):
        assert resp.status_code == 200
        chunks = resp.aiter_raw()
        got = b""
        async with asyncio.timeout(STEP_S):
            while len(got) < len(_envelope(0, {"event": {"start": {"pid": PID}}})) + 7:
                got += await anext(chunks)
        await setup.kill()
        with pytest.raises(httpx.RemoteProtocolError):
            async with asyncio.timeout(STEP_S):
                async for _ in chunks:
                    pass


async def test_sdk_command_on_a_killed_sandbox_raises_the_killed_error(setup: Setup) -> None:
    """What E2B's suites check (`test_kill_sandbox_while_command_is_running`, JS
    `sandboxKilledDuringRun`): `wait()` raises the SDK's not-running error, whose message
    says the sandbox was killed while the request was in flight."""
    opts: dict[str, Any] = {
        "api_key": "e2b_" + "0" * 40,
        "api_url": setup.url,
        "sandbox_url": setup.url,
        "request_timeout": STEP_S,
    }

    def start() -> Any:
        sbx = Sandbox.connect(SANDBOX_ID, **opts)
        return sbx.commands.run("sleep 60", background=True)

    async with asyncio.timeout(STEP_S):
        handle = await asyncio.to_thread(start)
    assert handle.pid == PID
    await setup.kill()
    async with asyncio.timeout(STEP_S):
        with pytest.raises(SandboxNotRunningException) as caught:
            await asyncio.to_thread(handle.wait)
    assert "sandbox was killed or reached its end of life" in str(caught.value)


async def test_a_reset_ends_a_code_interpreter_execution_with_an_error_saying_so(
    setup: Setup,
) -> None:
    """The code interpreter's `/execute` answer (port 49999, a line per message) cut by a
    reset between two lines ends with an execution error line naming the reset: the SDK's
    `run_code` returns the execution with that error (a dropped connection would be a bare
    protocol error, as the sandbox still runs). A kill still drops it."""
    from e2b_code_interpreter import Sandbox as CodeSandbox

    started = asyncio.Event()

    async def interpreter(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        while (await receive()).get("more_body"):
            pass
        hdrs = [(b"content-type", b"application/x-ndjson")]
        await send({"type": "http.response.start", "status": 200, "headers": hdrs})
        line = {"type": "stdout", "text": "started\n", "timestamp": "2026-12-06T00:00:00Z"}
        await send({"type": "http.response.body", "body": json.dumps(line).encode() + b"\n",
                    "more_body": True})  # fmt: skip
        started.set()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(OPEN_S):
                while (await receive())["type"] != "http.disconnect":
                    pass

    # The interpreter's own port on an address of its own (127/8 is all loopback here).
    address = "127.83.41.7"
    server, task, _ = await _serve(interpreter, host=address, port=49999)
    setup.records[SANDBOX_ID] = dataclasses.replace(setup.records[SANDBOX_ID], address=address)
    opts: dict[str, Any] = {
        "api_key": "e2b_" + "0" * 40,
        "api_url": setup.url,
        "sandbox_url": setup.url,
        "request_timeout": STEP_S,
    }
    try:
        sbx = await asyncio.to_thread(CodeSandbox.connect, SANDBOX_ID, **opts)
        code = "import time; time.sleep(60)"
        running = asyncio.create_task(asyncio.to_thread(sbx.run_code, code))
        async with asyncio.timeout(STEP_S):
            await started.wait()
            await asyncio.sleep(0.2)
            await setup.reset()
            execution = await running
        assert execution.logs.stdout == ["started\n"]
        assert execution.error is not None
        assert (execution.error.name, execution.error.value) == ("SandboxReset", RESET_WHY)

        headers = {"e2b-sandbox-id": SANDBOX_ID, "e2b-sandbox-port": "49999"}
        started.clear()
        async with (
            httpx.AsyncClient(base_url=setup.url, timeout=STEP_S) as client,
            client.stream("POST", "/execute", json={"code": "1"}, headers=headers) as resp,
        ):
            async with asyncio.timeout(STEP_S):
                await started.wait()
            await setup.kill()
            with pytest.raises(httpx.RemoteProtocolError):
                async with asyncio.timeout(STEP_S):
                    async for _ in resp.aiter_raw():
                        pass
    finally:
        server.should_exit = True
        await task


async def test_a_killed_sandbox_drops_an_open_websocket_without_a_close_frame(
    setup: Setup,
) -> None:
    """E2B's proxy resets the connections of a sandbox that stops, so a proxied WebSocket
    ends with no close frame (an abnormal closure, 1006), not a close the app could take for
    the guest's (1000) or a server error (1011)."""
    url = setup.url.replace("http://", "ws://") + "/"
    async with asyncio.timeout(STEP_S):
        ws = await websockets.connect(url, open_timeout=STEP_S, close_timeout=1)
    try:
        async with asyncio.timeout(STEP_S):
            assert await ws.recv() == "hello"
        await setup.kill()
        with pytest.raises(websockets.ConnectionClosedError) as caught:
            async with asyncio.timeout(STEP_S):
                await ws.recv()
        assert caught.value.rcvd is None, caught.value.rcvd
        assert ws.close_code == 1006
    finally:
        await ws.close()


async def test_js_sdk_command_on_a_killed_sandbox_raises_the_killed_error(
    setup: Setup, tmp_path: Any
) -> None:
    """The JS SDK (npm `e2b`, node) on the same cut: `wait()` rejects with its TimeoutError
    saying the sandbox was killed (tests/e2e/js/cut_stream.mjs)."""
    modules = await asyncio.to_thread(ensure_js_sdk)
    for name in ("lib.mjs", "cut_stream.mjs", "package.json"):
        shutil.copy2(JS_DIR / name, tmp_path / name)
    (tmp_path / "node_modules").symlink_to(modules)
    env = {
        **os.environ,
        "E2B_API_URL": setup.url,
        "E2B_SANDBOX_URL": setup.url,
        "E2B_API_KEY": "e2b_" + "0" * 40,
    }
    proc = await asyncio.create_subprocess_exec(
        "node", "cut_stream.mjs", "killed_while_running", SANDBOX_ID,
        cwd=tmp_path, env=env, stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    assert proc.stdout is not None
    out: list[str] = []
    try:
        # Node's start and the SDK's import take a few seconds on a busy machine.
        async with asyncio.timeout(STEP_S * 3):
            while not out or not out[-1].startswith("STARTED"):
                line = await proc.stdout.readline()
                assert line, "node ended before the command started:\n" + "".join(out)
                out.append(line.decode())
            assert out[-1].strip() == f"STARTED pid={PID}"
            await setup.kill()
            rest = await proc.stdout.read()
            out.append(rest.decode())
            code = await proc.wait()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    text = "".join(out)
    print(text, file=sys.stderr)
    assert code == 0, text
    assert "OK killed_while_running" in text, text
