"""envd inside a real microVM (the `base` template): a subset of tests/guest/envd, plus what only
the guest may do (`--guest`: /init sets the clock and hostname).

One VM per test; under TCG a boot costs seconds, so each test walks through many calls.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx
import pytest
from connectrpc.codec import proto_json_codec
from protobuf import Oneof

from agentenv.config import Settings
from agentenv.guest.envd import ENVD_VERSION
from agentenv.guest.envd.client import EnvdClient, basic_user
from agentenv.guest.envd.gen.filesystem import filesystem_pb as fpb
from agentenv.guest.envd.gen.filesystem.filesystem_connect import FilesystemClient
from agentenv.guest.envd.gen.process import process_pb as pb
from agentenv.guest.envd.gen.process.process_connect import ProcessClient
from agentenv.node.host import Node, SandboxHandle
from agentenv.snapshot.warmup import start_failures

pytestmark = pytest.mark.vm

MEM = 512


def basic(user: str) -> dict[str, str]:
    return {"Authorization": basic_user(user)}


def bash(cmd: str, *, stdin: bool = False) -> pb.StartRequest:
    return pb.StartRequest(
        process=pb.ProcessConfig(cmd="/bin/bash", args=["-l", "-c", cmd]), stdin=stdin
    )


def selector(pid: int) -> pb.ProcessSelector:
    return pb.ProcessSelector(selector=Oneof("pid", pid))


@dataclass
class Run:
    pid: int = 0
    stdout: bytearray = field(default_factory=bytearray)
    stderr: bytearray = field(default_factory=bytearray)
    pty: bytearray = field(default_factory=bytearray)
    end: pb.ProcessEvent.EndEvent | None = None
    kinds: list[str] = field(default_factory=list)


async def consume(stream: AsyncIterator[Any], run: Run | None = None) -> Run:
    run = run or Run()
    async for response in stream:
        event = response.event.event
        run.kinds.append(event.field)
        if event.field == "start":
            run.pid = event.value.pid
        elif event.field == "data":
            getattr(run, event.value.output.field).extend(event.value.output.value)
        elif event.field == "end":
            run.end = event.value
    return run


@pytest.fixture(scope="session")
def base_template(agentenv_home: Path) -> Any:
    from agentenv.template.rootfs import ensure_base

    return ensure_base(replace(Settings.from_env(), home=agentenv_home), None)


@pytest.fixture
async def sandbox(settings: Settings, base_template: Any) -> AsyncIterator[SandboxHandle]:
    async with Node(settings) as node:
        sb = await node.create("base", cpu=1, memory_mb=MEM, disk_size_mb=2048)
        try:
            yield sb
        finally:
            await node.delete(sb.id)


def _clients(url: str) -> tuple[ProcessClient, FilesystemClient]:
    return (
        ProcessClient(url, codec=proto_json_codec(), send_compression=None),
        FilesystemClient(url, codec=proto_json_codec(), send_compression=None),
    )


async def test_envd_in_guest(sandbox: SandboxHandle, tmp_path: Path) -> None:
    url = sandbox.envd_url
    async with httpx.AsyncClient(base_url=url, timeout=120, trust_env=False) as http:
        health = await http.get("/health")
        assert health.status_code == 204 and health.headers["x-envd-version"] == ENVD_VERSION

    async with EnvdClient(url, timeout=120) as client:
        # --guest: /init moves the wall clock and sets the hostname.
        ahead = time.time() + 3600
        await client.init(timestamp=ahead, hostname="envd-e2e", env_vars={"FROM_INIT": "yes"})
        result = await client.run("date +%s; hostname; echo $FROM_INIT", user="root")
        clock, hostname, env = result.stdout.split()
        assert abs(int(clock) - ahead) < 60
        assert (hostname, env) == ("envd-e2e", "yes")
        await client.init(timestamp=time.time())
        result = await client.run("date +%s", user="root")
        assert abs(int(result.stdout) - time.time()) < 60

        for user, home in [("root", "/root"), ("user", "/home/user")]:
            result = await client.run('whoami; echo "$HOME"; pwd', user=user)
            assert result.stdout.split() == [user, home, home], result

    processes, files = _clients(url)
    async with processes, files:
        run = await consume(processes.start(bash("echo out; echo err >&2; exit 3")))
        assert (bytes(run.stdout), bytes(run.stderr)) == (b"out\n", b"err\n")
        assert run.end is not None and (run.end.exit_code, run.end.status) == (3, "exit status 3")

        # stdin and signals
        stream = processes.start(bash("cat", stdin=True))
        pid = (await anext(stream)).event.event.value.pid
        await processes.send_input(
            pb.SendInputRequest(
                process=selector(pid), input=pb.ProcessInput(input=Oneof("stdin", b"ping\n"))
            )
        )
        await processes.close_stdin(pb.CloseStdinRequest(process=selector(pid)))
        run = await consume(stream, Run(pid=pid))
        assert bytes(run.stdout) == b"ping\n"

        stream = processes.start(bash("sleep 60"))
        pid = (await anext(stream)).event.event.value.pid
        await processes.send_signal(
            pb.SendSignalRequest(process=selector(pid), signal=pb.Signal.SIGTERM)
        )
        run = await asyncio.wait_for(consume(stream), 30)
        assert run.end is not None and run.end.status == "signal: terminated"

        # Disconnect, then reattach with Connect.
        stream = processes.start(bash("sleep 3; echo after"))
        pid = (await anext(stream)).event.event.value.pid
        await stream.aclose()  # type: ignore[attr-defined]
        run = await asyncio.wait_for(
            consume(processes.connect(pb.ConnectRequest(process=selector(pid)))), 60
        )
        assert run.kinds[0] == "start" and bytes(run.stdout) == b"after\n"

        # PTY: a terminal, resizable.
        request = pb.StartRequest(
            process=pb.ProcessConfig(cmd="/bin/bash", args=["-i", "-l"], envs={"TERM": "xterm"}),
            pty=pb.PTY(size=pb.PTY.Size(cols=80, rows=24)),
        )
        stream = processes.start(request, headers=basic("root"))
        pid = (await anext(stream)).event.event.value.pid
        run = Run(pid=pid)
        reader = asyncio.create_task(consume(stream, run))

        async def type_and_wait(text: bytes, marker: bytes) -> None:
            await processes.send_input(
                pb.SendInputRequest(
                    process=selector(pid), input=pb.ProcessInput(input=Oneof("pty", text))
                )
            )
            for _ in range(600):
                if marker in run.pty:
                    return
                await asyncio.sleep(0.05)
            raise AssertionError(f"{marker!r} not seen: {bytes(run.pty)[-300:]!r}")

        await type_and_wait(b"tty; stty size; echo A-$((1+1))\n", b"A-2")
        assert b"/dev/pts/" in run.pty and b"24 80" in run.pty
        await processes.update(
            pb.UpdateRequest(process=selector(pid), pty=pb.PTY(size=pb.PTY.Size(cols=120, rows=40)))
        )
        await type_and_wait(b"stty size; echo B-$((2+2))\n", b"B-4")
        assert b"40 120" in run.pty
        await processes.send_signal(
            pb.SendSignalRequest(process=selector(pid), signal=pb.Signal.SIGKILL)
        )
        await asyncio.wait_for(reader, 30)

        # Files: upload and download with a matching digest; ownership follows the user.
        blob = os.urandom(16 * 1024 * 1024)
        async with httpx.AsyncClient(base_url=url, timeout=300, trust_env=False) as http:
            up = await http.post(
                "/files",
                params={"path": "/home/user/blob.bin"},
                content=blob,
                headers={"content-type": "application/octet-stream"},
            )
            assert up.status_code == 200, up.text
            down = await http.get("/files", params={"path": "/home/user/blob.bin"})
            assert hashlib.sha256(down.content).hexdigest() == hashlib.sha256(blob).hexdigest()
        entry = (await files.stat(fpb.StatRequest(path="/home/user/blob.bin"))).entry
        assert entry is not None and entry.owner == "user" and entry.size == len(blob)

        # Watchers on inotify in the guest kernel.
        await files.make_dir(fpb.MakeDirRequest(path="/home/user/w"))
        wid = (
            await files.create_watcher(
                fpb.CreateWatcherRequest(path="/home/user/w", recursive=True)
            )
        ).watcher_id
        cmd = "cd /home/user/w && echo x > a && mv a b && rm b"
        assert (await consume(processes.start(bash(cmd)))).end is not None
        seen: set[tuple[str, fpb.EventType]] = set()
        for _ in range(100):
            events = (
                await files.get_watcher_events(fpb.GetWatcherEventsRequest(watcher_id=wid))
            ).events
            seen |= {(e.name, e.type) for e in events}
            if ("b", fpb.EventType.REMOVE) in seen:
                break
            await asyncio.sleep(0.1)
        assert {
            ("a", fpb.EventType.CREATE),
            ("a", fpb.EventType.WRITE),
            ("a", fpb.EventType.RENAME),
            ("b", fpb.EventType.CREATE),
            ("b", fpb.EventType.REMOVE),
        } <= seen
        await files.remove_watcher(fpb.RemoveWatcherRequest(watcher_id=wid))

        # As upstream envd: file operations run as root whoever asks (the user names only
        # where `~` is and who owns what is made), so the default user lists /root.
        listed = await files.list_dir(fpb.ListDirRequest(path="/root"), headers=basic("user"))
        assert all(e.path.startswith("/root/") for e in listed.entries)

    # What a template's build reads before its capture: nothing recorded (the base template
    # has no start hooks), then a hook's failure as the guest init records it, with its log.
    assert await start_failures(url) is None
    async with EnvdClient(url, timeout=120) as client:
        await client.write_file("/run/agentenv/start-10-svc.log", b"one\ntwo\n", "root")
        await client.write_file("/run/agentenv/start-failed", b"10-svc: exit 1 after 3s\n", "root")
        try:
            assert await start_failures(url) == "10-svc: exit 1 after 3s (its log ends: one | two)"
        finally:
            await client.run("rm /run/agentenv/start-failed", user="root")

    # Secure mode, last: from here on every call needs the token.
    async with EnvdClient(url, timeout=120) as client:
        await client.init(access_token="guest-secret")
        async with httpx.AsyncClient(base_url=url, timeout=60, trust_env=False) as http:
            denied = await http.post(
                "/process.Process/List", json={}, headers={"content-type": "application/json"}
            )
            assert denied.status_code == 401
            assert (await http.get("/files", params={"path": "/etc/hostname"})).status_code == 401
        assert (await client.run("echo secured", user="root")).stdout == "secured\n"


async def test_e2b_sdk_against_guest_envd(
    sandbox: SandboxHandle, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("E2B_DEBUG", "true")
    monkeypatch.setenv("E2B_SANDBOX_URL", sandbox.envd_url)
    monkeypatch.setenv("E2B_API_KEY", "unused-in-debug-mode")
    monkeypatch.delenv("HTTP_PROXY", raising=False)
    monkeypatch.delenv("http_proxy", raising=False)

    def scenario() -> None:
        from e2b import Sandbox
        from e2b.sandbox.commands.command_handle import CommandExitException

        sbx = Sandbox.create()
        result = sbx.commands.run("echo $HOME; whoami; uname -r", timeout=120)
        home, who, release = result.stdout.split()
        assert (home, who) == ("/home/user", "user")
        assert release != os.uname().release
        with pytest.raises(CommandExitException):
            sbx.commands.run("exit 7", timeout=120)
        sbx.files.write("/home/user/sdk.txt", "from the sdk")
        assert sbx.files.read("/home/user/sdk.txt") == "from the sdk"
        assert sbx.files.get_info("/home/user/sdk.txt").owner == "user"
        handle = sbx.commands.run("sleep 100", background=True, timeout=120)
        assert sbx.commands.kill(handle.pid)
        assert sbx.is_running()

        # The base template has `python` (python-is-python3), as E2B's does.
        assert sbx.commands.run("python --version", timeout=120).stdout.startswith("Python 3.")
        # A background server does not hold its command open until the timeout.
        t0 = time.monotonic()
        started = sbx.commands.run(
            "python -m http.server 8000 --bind 127.0.0.1 & echo $! > /tmp/srv.pid; echo started",
            timeout=120,
        )
        assert started.stdout == "started\n" and time.monotonic() - t0 < 60
        probe = (
            "for i in $(seq 300); do curl -sf http://127.0.0.1:8000/ >/dev/null && echo up && "
            "exit 0; sleep 0.2; done; exit 1"
        )
        assert sbx.commands.run(probe, timeout=120).stdout == "up\n"
        sbx.commands.run("kill $(cat /tmp/srv.pid)", timeout=120)
        # procfs says 0 bytes; the content comes whole, and the next call works.
        boot_id = sbx.files.read("/proc/sys/kernel/random/boot_id")
        assert len(boot_id.strip()) == 36
        cat = sbx.commands.run("cat /proc/sys/kernel/random/boot_id", timeout=120)
        assert cat.stdout == boot_id
        # Missing parents are made for the user; relative cwd starts at home; removing
        # nothing is not an error.
        sbx.files.write("/home/user/a/b/c.txt", "nested")
        assert sbx.files.get_info("/home/user/a/b").owner == "user"
        assert sbx.commands.run("pwd", cwd="a/b", timeout=120).stdout == "/home/user/a/b\n"
        sbx.files.remove("/home/user/never-there")

    await asyncio.to_thread(scenario)
