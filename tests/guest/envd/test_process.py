"""process.Process against a real envd subprocess, through the generated Connect client."""

# The tests inspect the real filesystem with blocking calls on purpose, beside envd.
# ruff: noqa: ASYNC210

from __future__ import annotations

import asyncio
import base64
import json
import time

import httpx
import pytest
from connectrpc.code import Code
from connectrpc.errors import ConnectError
from protobuf import Oneof

from agentenv.guest.envd.gen.process import process_pb as pb
from agentenv.guest.envd.gen.process.process_connect import ProcessClient

from .conftest import EnvdProc, basic
from .helpers import (
    STREAM_HEADERS,
    UNARY_HEADERS,
    FrameReader,
    Run,
    bash,
    consume,
    envelope,
    run_cmd,
    selector,
    tag_selector,
    wait_gone,
)


async def test_start_streams_start_output_end(process_client: ProcessClient) -> None:
    run = await run_cmd(process_client, bash("echo out; echo err >&2; exit 3"))
    assert run.kinds[0] == "start" and run.pid > 0
    assert run.kinds[-1] == "end"
    assert run.stdout == b"out\n"
    assert run.stderr == b"err\n"
    assert run.end is not None
    assert (run.end.exit_code, run.end.exited, run.end.status) == (3, True, "exit status 3")
    assert run.end.error == "exit status 3"


async def test_success_has_no_error(process_client: ProcessClient) -> None:
    run = await run_cmd(process_client, bash("true"))
    assert run.end is not None
    assert (run.end.exit_code, run.end.exited, run.end.status) == (0, True, "exit status 0")
    assert not run.end.error


async def test_env_cwd_and_sandbox_env(process_client: ProcessClient, envd: EnvdProc) -> None:
    httpx.post(envd.url + "/init", json={"envVars": {"SANDBOX_VAR": "sv", "FOO": "sandbox"}})
    run = await run_cmd(
        process_client,
        bash("echo $FOO $SANDBOX_VAR; pwd", envs={"FOO": "request"}, cwd="/tmp"),
        headers=basic("root"),
    )
    assert run.stdout.decode().split() == ["request", "sv", "/tmp"]


@pytest.mark.parametrize("user", ["root", "user"])
async def test_runs_as_requested_user(process_client: ProcessClient, user: str) -> None:
    run = await run_cmd(
        process_client,
        bash(
            'whoami; echo "$HOME $USER $LOGNAME"; pwd; id -u; '
            "touch owned-file; stat -c %U owned-file; rm owned-file"
        ),
        headers=basic(user),
    )
    home = "/root" if user == "root" else "/home/user"
    lines = run.stdout.decode().splitlines()
    assert lines[0] == user
    assert lines[1] == f"{home} {user} {user}"
    assert lines[2] == home
    assert (lines[3] == "0") == (user == "root")
    assert lines[4] == user


async def test_default_user_is_user(process_client: ProcessClient) -> None:
    run = await run_cmd(process_client, bash("whoami"))
    assert run.stdout == b"user\n"


async def test_unknown_user_is_unauthenticated(process_client: ProcessClient) -> None:
    with pytest.raises(ConnectError) as err:
        await run_cmd(process_client, bash("true"), headers=basic("nobody-here"))
    assert err.value.code == Code.UNAUTHENTICATED


async def test_bad_command_and_cwd_are_invalid_argument(process_client: ProcessClient) -> None:
    request = pb.StartRequest(process=pb.ProcessConfig(cmd="/no/such/binary"))
    with pytest.raises(ConnectError) as err:
        await run_cmd(process_client, request)
    assert err.value.code == Code.INVALID_ARGUMENT
    with pytest.raises(ConnectError) as err:
        await run_cmd(process_client, bash("true", cwd="/no/such/dir"))
    assert err.value.code == Code.INVALID_ARGUMENT


async def test_stdin_send_and_close(process_client: ProcessClient) -> None:
    stream = process_client.start(bash("cat; echo done", stdin=True))
    first = await anext(stream)
    pid = first.event.event.value.pid
    await process_client.send_input(
        pb.SendInputRequest(
            process=selector(pid), input=pb.ProcessInput(input=Oneof("stdin", b"abc\n"))
        )
    )
    await process_client.close_stdin(pb.CloseStdinRequest(process=selector(pid)))
    run = await consume(stream, Run(pid=pid))
    assert run.stdout == b"abc\ndone\n"
    assert run.end is not None and run.end.exit_code == 0


async def test_stdin_absent_means_a_pipe(process_client: ProcessClient) -> None:
    """Older SDKs never send `stdin`; they expect a pipe, as upstream envd gives them."""
    stream = process_client.start(bash("cat", stdin=None))
    pid = (await anext(stream)).event.event.value.pid
    await process_client.send_input(
        pb.SendInputRequest(
            process=selector(pid), input=pb.ProcessInput(input=Oneof("stdin", b"piped\n"))
        )
    )
    await process_client.close_stdin(pb.CloseStdinRequest(process=selector(pid)))
    run = await consume(stream, Run(pid=pid))
    assert run.stdout == b"piped\n"


async def test_stdin_false_is_devnull(process_client: ProcessClient) -> None:
    run = await asyncio.wait_for(run_cmd(process_client, bash("cat; echo eof")), 10)
    assert run.stdout == b"eof\n"


async def test_stream_input_applies_frames_as_they_arrive(process_client: ProcessClient) -> None:
    stream = process_client.start(bash("head -n 1; echo got-first; cat", stdin=True))
    pid = (await anext(stream)).event.event.value.pid
    got_first = asyncio.Event()
    run = Run(pid=pid)

    async def reader() -> None:
        async for response in stream:
            event = response.event.event
            if event.field == "data":
                run.stdout.extend(event.value.output.value)
                if b"got-first" in run.stdout:
                    got_first.set()
            elif event.field == "end":
                run.end = event.value

    task = asyncio.create_task(reader())

    async def frames():  # type: ignore[no-untyped-def]
        yield pb.StreamInputRequest(
            event=Oneof("start", pb.StreamInputRequest.StartEvent(process=selector(pid)))
        )
        yield pb.StreamInputRequest(
            event=Oneof(
                "data",
                pb.StreamInputRequest.DataEvent(
                    input=pb.ProcessInput(input=Oneof("stdin", b"x\n"))
                ),
            )
        )
        # The body stays open: envd must act on the first frames before it ends.
        await asyncio.wait_for(got_first.wait(), 10)
        yield pb.StreamInputRequest(event=Oneof("keepalive", pb.StreamInputRequest.KeepAlive()))
        yield pb.StreamInputRequest(
            event=Oneof(
                "data",
                pb.StreamInputRequest.DataEvent(input=pb.ProcessInput(input=Oneof("stdin", b"y"))),
            )
        )

    await process_client.stream_input(frames())
    await process_client.close_stdin(pb.CloseStdinRequest(process=selector(pid)))
    await asyncio.wait_for(task, 10)
    assert run.stdout == b"x\ngot-first\ny"


async def test_pty_is_a_terminal_and_resizes(process_client: ProcessClient) -> None:
    request = pb.StartRequest(
        process=pb.ProcessConfig(cmd="/bin/bash", args=["-i", "-l"], envs={"TERM": "xterm"}),
        pty=pb.PTY(size=pb.PTY.Size(cols=80, rows=24)),
    )
    stream = process_client.start(request, headers=basic("root"))
    pid = (await anext(stream)).event.event.value.pid
    run = Run(pid=pid)
    task = asyncio.create_task(consume(stream, run))

    async def send(text: str) -> None:
        await process_client.send_input(
            pb.SendInputRequest(
                process=selector(pid), input=pb.ProcessInput(input=Oneof("pty", text.encode()))
            )
        )

    async def wait_for(marker: bytes) -> None:
        for _ in range(200):
            if marker in run.pty:
                return
            await asyncio.sleep(0.05)
        raise AssertionError(f"{marker!r} not in {bytes(run.pty)[-500:]!r}")

    await send("tty; echo T-$((1+1)); stty size; echo S-$((2+2))\n")
    await wait_for(b"S-4")
    assert b"/dev/pts/" in run.pty
    assert b"24 80" in run.pty
    await process_client.update(
        pb.UpdateRequest(process=selector(pid), pty=pb.PTY(size=pb.PTY.Size(cols=100, rows=30)))
    )
    await send("stty size; echo R-$((3+3))\n")
    await wait_for(b"R-6")
    assert b"30 100" in run.pty
    await process_client.send_signal(
        pb.SendSignalRequest(process=selector(pid), signal=pb.Signal.SIGKILL)
    )
    await asyncio.wait_for(task, 10)
    assert run.end is not None
    assert (run.end.exit_code, run.end.exited, run.end.status) == (-1, False, "signal: killed")


async def test_close_stdin_on_pty_is_refused(process_client: ProcessClient) -> None:
    request = pb.StartRequest(
        process=pb.ProcessConfig(cmd="/bin/cat"), pty=pb.PTY(size=pb.PTY.Size(cols=80, rows=24))
    )
    stream = process_client.start(request)
    pid = (await anext(stream)).event.event.value.pid
    with pytest.raises(ConnectError) as err:
        await process_client.close_stdin(pb.CloseStdinRequest(process=selector(pid)))
    assert err.value.code == Code.FAILED_PRECONDITION
    await process_client.send_signal(
        pb.SendSignalRequest(process=selector(pid), signal=pb.Signal.SIGKILL)
    )
    await consume(stream)


@pytest.mark.parametrize(
    ("signal", "status"),
    [(pb.Signal.SIGTERM, "signal: terminated"), (pb.Signal.SIGKILL, "signal: killed")],
)
async def test_signals(process_client: ProcessClient, signal: pb.Signal, status: str) -> None:
    stream = process_client.start(bash("sleep 60"))
    pid = (await anext(stream)).event.event.value.pid
    await process_client.send_signal(pb.SendSignalRequest(process=selector(pid), signal=signal))
    run = await asyncio.wait_for(consume(stream), 10)
    assert run.end is not None
    assert (run.end.exit_code, run.end.status) == (-1, status)
    await wait_gone(process_client, pid)
    with pytest.raises(ConnectError) as err:
        await process_client.send_signal(pb.SendSignalRequest(process=selector(pid), signal=signal))
    assert err.value.code == Code.NOT_FOUND


async def test_list_and_connect_by_pid_and_tag(process_client: ProcessClient) -> None:
    script = "for i in $(seq 1 30); do echo line-$i; sleep 0.1; done"
    stream = process_client.start(bash(script, tag="ticker"))
    first = await anext(stream)
    pid = first.event.event.value.pid
    await stream.aclose()  # disconnect: the process must keep running
    await asyncio.sleep(0.8)

    listed = (await process_client.list(pb.ListRequest())).processes
    mine = [p for p in listed if p.pid == pid]
    assert mine and mine[0].tag == "ticker"
    assert mine[0].config is not None and mine[0].config.args[-1] == script

    run = await asyncio.wait_for(
        consume(process_client.connect(pb.ConnectRequest(process=selector(pid)))), 20
    )
    assert run.kinds[0] == "start" and run.pid == pid
    assert run.stdout.endswith(b"line-30\n")
    assert not run.stdout.startswith(b"line-1\n"), "reattach must only get output from now on"
    assert run.end is not None and run.end.exit_code == 0

    stream = process_client.start(bash("sleep 0.5; echo tagged-done", tag="by-tag"))
    await anext(stream)
    run = await consume(process_client.connect(pb.ConnectRequest(process=tag_selector("by-tag"))))
    assert run.stdout == b"tagged-done\n"
    await consume(stream)


async def test_connect_to_unknown_pid_is_not_found(process_client: ProcessClient) -> None:
    with pytest.raises(ConnectError) as err:
        await consume(process_client.connect(pb.ConnectRequest(process=selector(999_999))))
    assert err.value.code == Code.NOT_FOUND


async def test_timeout_kills_process(process_client: ProcessClient) -> None:
    started = time.monotonic()
    stream = process_client.start(bash("sleep 30"), timeout_ms=1500)
    pid = (await anext(stream)).event.event.value.pid
    with pytest.raises(ConnectError) as err:
        await consume(stream)
    assert err.value.code == Code.DEADLINE_EXCEEDED
    await wait_gone(process_client, pid)
    assert time.monotonic() - started < 10


async def test_server_side_deadline_without_client_deadline(envd: EnvdProc) -> None:
    """The deadline is envd's, not only the client's: a raw request gets deadline_exceeded."""
    headers = {**STREAM_HEADERS, "connect-timeout-ms": "800"}
    body = envelope({"process": {"cmd": "/bin/sleep", "args": ["30"]}, "stdin": False})
    frames = []
    async with (
        httpx.AsyncClient(timeout=20) as client,
        client.stream(
            "POST", envd.url + "/process.Process/Start", content=body, headers=headers
        ) as response,
    ):
        reader = FrameReader()
        async for chunk in response.aiter_bytes():
            frames += reader.feed(chunk)
    flags, payload = frames[-1]
    assert flags == 2
    assert json.loads(payload)["error"]["code"] == "deadline_exceeded"


async def test_keepalive_when_silent(envd: EnvdProc) -> None:
    headers = {**STREAM_HEADERS, "keepalive-ping-interval": "1"}
    body = envelope({"process": {"cmd": "/bin/sh", "args": ["-c", "sleep 2.6; echo hi"]}})
    kinds = []
    async with (
        httpx.AsyncClient(timeout=20) as client,
        client.stream(
            "POST", envd.url + "/process.Process/Start", content=body, headers=headers
        ) as response,
    ):
        reader = FrameReader()
        async for chunk in response.aiter_bytes():
            for flags, payload in reader.feed(chunk):
                if flags == 0:
                    kinds.append(next(iter(json.loads(payload)["event"])))
    assert kinds[0] == "start"
    assert kinds.count("keepalive") >= 2
    assert kinds[-2:] == ["data", "end"]


async def test_100mb_output_streams_in_bounded_memory(envd: EnvdProc) -> None:
    total = 100 * 1000 * 1000
    body = envelope(
        {
            "process": {"cmd": "/bin/sh", "args": ["-c", f"head -c {total} /dev/zero"]},
            "stdin": False,
        }
    )
    received = 0
    end = None
    rss_peak = 0.0
    async with (
        httpx.AsyncClient(timeout=120) as client,
        client.stream(
            "POST", envd.url + "/process.Process/Start", content=body, headers=STREAM_HEADERS
        ) as response,
    ):
        assert response.headers["content-type"] == "application/connect+json"
        reader = FrameReader()
        n = 0
        async for chunk in response.aiter_raw():
            for _flags, payload in reader.feed(chunk):
                event = json.loads(payload).get("event", {})
                if "data" in event:
                    received += len(base64.b64decode(event["data"]["stdout"]))
                elif "end" in event:
                    end = event["end"]
            n += 1
            if n % 200 == 0:
                rss_peak = max(rss_peak, envd.rss_mib())
                # A slow reader: envd must hold the process back, not buffer for it.
                await asyncio.sleep(0.002)
    assert received == total
    assert end is not None and end.get("exitCode", 0) == 0
    assert rss_peak < 150, f"envd RSS reached {rss_peak:.0f} MiB"


async def test_disconnect_keeps_background_process_and_leaks_no_fds(envd: EnvdProc) -> None:
    # Raw httpx clients that are closed explicitly: the Connect client's pool would keep
    # sockets open in envd and blur the count.
    async def fd_count() -> int:
        await asyncio.sleep(0.3)
        return len(envd.fds())

    async def unary(method: str, body: dict[str, object]) -> httpx.Response:
        async with httpx.AsyncClient(timeout=10) as client:
            return await client.post(
                f"{envd.url}/process.Process/{method}", json=body, headers=UNARY_HEADERS
            )

    async def pids() -> set[int]:
        return {p["pid"] for p in (await unary("List", {})).json().get("processes", [])}

    before = await fd_count()
    body = envelope(
        {
            "process": {
                "cmd": "/bin/sh",
                "args": ["-c", "while true; do echo tick; sleep 0.05; done"],
            }
        }
    )
    async with httpx.AsyncClient(timeout=10) as client:
        async with client.stream(
            "POST", envd.url + "/process.Process/Start", content=body, headers=STREAM_HEADERS
        ) as response:
            reader = FrameReader()
            frames: list[tuple[int, bytes]] = []
            async for chunk in response.aiter_raw():
                frames += reader.feed(chunk)
                if len(frames) >= 3:
                    break
        pid = json.loads(frames[0][1])["event"]["start"]["pid"]
    await asyncio.sleep(1.0)
    assert pid in await pids(), "disconnecting must not kill the process"
    response = await unary("SendSignal", {"process": {"pid": pid}, "signal": "SIGNAL_SIGKILL"})
    assert response.status_code == 200
    for _ in range(100):
        if pid not in await pids():
            break
        await asyncio.sleep(0.05)
    assert pid not in await pids()

    # A PTY process, killed while attached: its terminal fds must go too.
    pty_body = envelope({"process": {"cmd": "/bin/cat"}, "pty": {"size": {"cols": 80, "rows": 24}}})
    async with (
        httpx.AsyncClient(timeout=10) as client,
        client.stream(
            "POST", envd.url + "/process.Process/Start", content=pty_body, headers=STREAM_HEADERS
        ) as response,
    ):
        reader = FrameReader()
        frames = []
        async for chunk in response.aiter_raw():
            frames += reader.feed(chunk)
            if frames:
                pty_pid = json.loads(frames[0][1])["event"]["start"]["pid"]
                killed = await unary(
                    "SendSignal", {"process": {"pid": pty_pid}, "signal": "SIGNAL_SIGKILL"}
                )
                assert killed.status_code == 200
                break
    for _ in range(100):
        if pty_pid not in await pids():
            break
        await asyncio.sleep(0.05)
    assert pty_pid not in await pids()
    after = before + 1
    for _ in range(20):
        after = await fd_count()
        if after <= before:
            break
    assert after <= before, f"fds grew from {before} to {after}: {envd.fds()}"


async def test_stalled_reader_holds_the_process_back(envd: EnvdProc) -> None:
    """A client that stops reading must block the process, not grow envd's memory."""
    body = envelope({"process": {"cmd": "/bin/sh", "args": ["-c", "cat /dev/zero"]}})
    rss_before = envd.rss_mib()
    async with (
        httpx.AsyncClient(timeout=30) as client,
        client.stream(
            "POST", envd.url + "/process.Process/Start", content=body, headers=STREAM_HEADERS
        ) as response,
    ):
        reader = FrameReader()
        frames: list[tuple[int, bytes]] = []
        async for chunk in response.aiter_raw():
            frames += reader.feed(chunk)
            if frames:
                break
        pid = json.loads(frames[0][1])["event"]["start"]["pid"]
        # Not reading for a while: `cat /dev/zero` would produce gigabytes meanwhile.
        peak = 0.0
        for _ in range(30):
            await asyncio.sleep(0.1)
            peak = max(peak, envd.rss_mib())
        assert peak - rss_before < 64, f"envd grew from {rss_before:.0f} to {peak:.0f} MiB"
        async with httpx.AsyncClient(timeout=10) as other:
            killed = await other.post(
                envd.url + "/process.Process/SendSignal",
                json={"process": {"pid": pid}, "signal": "SIGNAL_SIGKILL"},
                headers=UNARY_HEADERS,
            )
            assert killed.status_code == 200
