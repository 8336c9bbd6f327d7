"""The node RPC end to end on loopback: a real server (uvicorn, in this loop or its own
process) in front of `MemoryRuntime`, and the real `RemoteRuntime` client."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import os
import signal
import socket
import statistics
import sys
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from pathlib import Path

import httpx
import pytest

from agentenv.config import NodeRpcConfig
from agentenv.contract import errors as api_errors
from agentenv.contract import runtime as rt
from agentenv.contract.errors import BadRequest
from agentenv.contract.runtime import (
    Found,
    GuestCommand,
    HostMemory,
    ImportEvent,
    Runtime,
    SandboxSpec,
    SnapshotInfo,
    TemplateInfo,
)
from agentenv.network.egress import OPEN, Egress
from agentenv.noderpc import node_streams
from agentenv.noderpc.client import RemoteRuntime
from agentenv.noderpc.errors import KINDS, NodeError, NodeUnreachable
from agentenv.noderpc.server import NodeServer

from .memruntime import MemoryRuntime

TOKEN = "node-secret-token"
FAST = NodeRpcConfig(query_s=5.0, change_s=5.0, long_s=10.0, connect_s=2.0, retry_after_s=3)
SERVE = Path(__file__).with_name("serve_memory.py")


@pytest.fixture
async def node() -> AsyncIterator[tuple[MemoryRuntime, NodeServer]]:
    runtime = MemoryRuntime()
    server = NodeServer(runtime, "127.0.0.1", 0, TOKEN, heartbeat_s=0.2)
    await server.start()
    try:
        yield runtime, server
    finally:
        await server.stop()


@pytest.fixture
async def client(node: tuple[MemoryRuntime, NodeServer]) -> AsyncIterator[RemoteRuntime]:
    remote = RemoteRuntime(node[1].url, TOKEN, config=FAST, watch_silence_s=2.0)
    await remote.start()
    try:
        yield remote
    finally:
        await remote.close()


def full_spec(sandbox_id: str = "sb-1", template: str = "base") -> SandboxSpec:
    egress = Egress.of(
        internet=False,
        allow_out=["10.1.0.0/16", "api.example.com", "*.pypi.org"],
        deny_out=["10.1.2.0/24", "evil.example.net"],
        dns_servers=["1.1.1.1", "9.9.9.9"],
    )
    return SandboxSpec(
        sandbox_id=sandbox_id,
        template=template,
        cpu=2,
        memory_mb=1024,
        disk_size_mb=4096,
        egress=egress,
        env_vars={"A": "1", "PATH_EXTRA": "/opt/bin", "EMPTY": "", "UNICODE": "žluť 🐍"},
        envd_token="envd-tok-123",
        metadata={"team": "t1", "purpose": "round trip"},
    )


def last(runtime: MemoryRuntime) -> tuple[str, tuple[object, ...]]:
    return runtime.calls[-1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Subserver:
    """`serve_memory.py` as its own process (SIGKILL-able, restartable on one port)."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.proc: asyncio.subprocess.Process | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> None:
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable, str(SERVE), str(self.port), TOKEN, stdout=asyncio.subprocess.PIPE
        )
        assert self.proc.stdout is not None
        async with asyncio.timeout(20):
            line = await self.proc.stdout.readline()
        assert line.startswith(b"listening"), line

    async def kill(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.send_signal(signal.SIGKILL)
            async with asyncio.timeout(10):
                await self.proc.wait()


@pytest.fixture
async def subserver() -> AsyncIterator[Subserver]:
    sub = Subserver(free_port())
    try:
        yield sub
    finally:
        await sub.kill()


# values ------------------------------------------------------------------------------------


def test_remote_runtime_is_a_runtime() -> None:
    # mypy checks this assignment (the protocol); at run time, that the methods exist.
    remote: Runtime = RemoteRuntime("http://127.0.0.1:1", TOKEN)
    for name in [n for n in dir(Runtime) if not n.startswith("_")]:
        assert callable(getattr(remote, name)), name


async def test_every_method_round_trips_its_values(
    node: tuple[MemoryRuntime, NodeServer], client: RemoteRuntime
) -> None:
    runtime, _ = node
    spec = full_spec()
    placement = await client.create(spec)
    assert last(runtime) == ("create", (spec,))
    got_spec = last(runtime)[1][0]
    assert isinstance(got_spec, SandboxSpec)
    assert got_spec.egress.dns_servers == (
        ipaddress.IPv4Address("1.1.1.1"),
        ipaddress.IPv4Address("9.9.9.9"),
    )
    assert got_spec.egress.allow_domains == ("api.example.com", "*.pypi.org")
    assert placement == runtime.placement("sb-1")

    # The smallest spec: every optional left out, egress open.
    bare = SandboxSpec(sandbox_id="sb-2", template="base", cpu=1, memory_mb=512)
    await client.create(bare)
    assert last(runtime) == ("create", (bare,))
    assert bare.egress == OPEN
    # Resolvers set to none is not the same as resolvers left out.
    no_dns = SandboxSpec("sb-3", "base", 1, 512, egress=Egress.of(internet=False, dns_servers=[]))
    await client.create(no_dns)
    assert last(runtime) == ("create", (no_dns,))
    # A create's own wait for capacity; 0 (refuse at once) is not the same as none given
    # (the node's default).
    for wait in (45.0, 0.0):
        waits = SandboxSpec("sb-3", "base", 1, 512, capacity_wait_s=wait)
        await client.create(waits)
        assert last(runtime) == ("create", (waits,))

    assert await client.find("sb-1") == Found("running", runtime.placement("sb-1"), True)
    assert await client.find("nope") is None
    assert await client.is_alive("sb-1") is True
    assert await client.is_alive("nope") is False
    await client.init_guest(spec)
    assert last(runtime) == ("init_guest", (spec,))
    assert await client.guest_metrics("sb-1", "tok") == {
        "ts": 1_700_000_000,
        "cpu_pct": 12.5,
        "mem_used": 104857600,
        "disks": [{"a": None}],
    }
    assert last(runtime) == ("guest_metrics", ("sb-1", "tok"))
    assert await client.guest_metrics("nope", None) is None
    with pytest.raises(NodeError, match="not JSON"):
        await client.guest_metrics("binary", None)
    assert await client.guest_health("sb-1") is None
    assert await client.guest_health("nope") == "envd: connection refused"
    assert sorted(await client.sandbox_ids()) == ["sb-1", "sb-2", "sb-3"]

    new_egress = Egress.of(internet=True, deny_out=["203.0.113.0/24", "ads.example.org"])
    await client.update_egress("sb-1", new_egress)
    assert runtime.held["sb-1"].egress == new_egress

    await client.pause("sb-1", memory=False, envd_token="tok", strict=False)
    assert last(runtime) == ("pause", ("sb-1", False, "tok", False))
    await client.pause("sb-2")
    assert last(runtime) == ("pause", ("sb-2", True, None, True))
    assert await client.find("sb-1") == Found("paused", None, memory=False)
    assert await client.find("sb-2") == Found("paused", None, memory=True)

    resumed = await client.resume(spec, memory=True)
    assert last(runtime) == ("resume", (spec, True))
    assert resumed.booted is True  # its pause kept no memory: a cold boot
    assert (await client.resume(bare)).booted is False
    reset = replace(spec, template="snap-1")
    assert (await client.reset(reset)).sandbox_id == spec.sandbox_id
    assert last(runtime) == ("reset", (reset,))
    await client.pause("sb-2")
    # A refusal arrives as its contract class: the control plane then deletes and creates.
    with pytest.raises(rt.Unsupported, match="paused"):
        await client.reset(replace(spec, sandbox_id="sb-2"))
    await client.resume(replace(spec, sandbox_id="sb-2"))

    assert await client.host_memory("sb-1") == HostMemory(
        300 << 20, 200 << 20, 150 << 20, 49 << 20, 1 << 20
    )
    assert await client.host_memory("nope") is None

    first = await client.snapshot("sb-1", None, None)
    assert last(runtime) == ("snapshot", ("sb-1", None, None, True))
    named = await client.snapshot("sb-1", "my-snap", "tok", memory=False)
    assert last(runtime) == ("snapshot", ("sb-1", "my-snap", "tok", False))
    assert named == SnapshotInfo("snap-2", ["my-snap"], "sb-1", 1_700_000_001.25, 2, 1024)
    assert await client.snapshots() == [first, named]

    children = [full_spec("child-1"), SandboxSpec("child-2", "base", 2, 1024, envd_token="c2")]
    placements = await client.fork("sb-1", children, "tok")
    assert last(runtime) == ("fork", ("sb-1", children, "tok"))
    assert placements == [runtime.placement("child-1"), runtime.placement("child-2")]
    assert await client.fork("sb-1", [], None) == []

    assert await client.lost_reason("sb-9") is None
    runtime.lost["sb-9"] = "VM exited"
    assert await client.lost_reason("sb-9") == "VM exited"

    await client.delete("sb-1")
    assert last(runtime) == ("delete", ("sb-1",))
    assert "sb-1" not in runtime.held


async def test_an_image_import_streams_its_reports_then_the_template(
    node: tuple[MemoryRuntime, NodeServer], client: RemoteRuntime
) -> None:
    runtime, _ = node
    events: list[ImportEvent] = []
    info = await client.import_image("reg.test/app:1", "image-x", ("u", "p"), events.append)
    assert runtime.calls[-1] == ("import_image", ("reg.test/app:1", "image-x", ("u", "p")))
    assert info == TemplateInfo("image-x", 64, 1.0, 1.0, 1, 512, layers=("e" * 64,),
                                env=(("A", "b"),), user="app", workdir="/app")  # fmt: skip
    assert events[0] == ImportEvent(message="pulling reg.test/app:1")
    assert events[1].layer is not None and events[1].layer["done"] == 10
    # Without credentials none travel; a failure arrives as the contract's class.
    await client.import_image("reg.test/app:1", "image-x", None, events.append)
    assert runtime.calls[-1][1][2] is None
    runtime.fail = BadRequest("bad reference")
    with pytest.raises(BadRequest, match="bad reference"):
        await client.import_image("::", "image-y", None, events.append)


async def test_guest_calls_stream_output_and_carry_their_values(
    node: tuple[MemoryRuntime, NodeServer], client: RemoteRuntime
) -> None:
    runtime, _ = node
    lines: list[tuple[str, str]] = []
    cmd = GuestCommand("make all", user="app", envs={"A": "1", "U": "žluť"}, cwd="/w",
                       timeout_s=7.0)  # fmt: skip
    code = await client.guest_run("sb-1", "tok", cmd, lambda line, s: lines.append((line, s)))
    assert code == len("make all")
    assert lines == [("ran make all", "stdout"), ("as app in /w", "stderr")]
    assert last(runtime) == ("guest_run", ("sb-1", "tok", cmd))
    # No token, no cwd: both arrive as None, not "".
    await client.guest_run("sb-1", None, GuestCommand("true"), lambda _l, _s: None)
    assert last(runtime) == ("guest_run", ("sb-1", None, GuestCommand("true")))
    data = bytes(range(256)) * 4
    await client.guest_write("sb-1", "tok", "/tmp/x.tar", data, append=True)
    assert last(runtime) == ("guest_write", ("sb-1", "tok", "/tmp/x.tar", data, True))
    await client.guest_defaults("sb-1", None, "app", "/home/app")
    assert last(runtime) == ("guest_defaults", ("sb-1", None, "app", "/home/app"))
    runtime.fail = rt.GuestFailed("sandbox sb-1: envd refused")
    with pytest.raises(rt.GuestFailed, match="envd refused"):
        await client.guest_run("sb-1", None, GuestCommand("true"), lambda _l, _s: None)


async def test_delete_snapshot_says_whether_there_was_one(
    node: tuple[MemoryRuntime, NodeServer], client: RemoteRuntime
) -> None:
    runtime, _ = node
    runtime.snaps = [SnapshotInfo("a" * 32, ["s"], "sb-1", 1.0, 1, 512)]
    assert await client.delete_snapshot("a" * 32) is True
    assert await client.delete_snapshot("a" * 32) is False


async def test_remove_image_says_whether_there_was_one_and_carries_refusals(
    node: tuple[MemoryRuntime, NodeServer], client: RemoteRuntime
) -> None:
    runtime, _ = node
    runtime.images = {"image-abc"}
    assert await client.remove_image("image-abc") is True
    assert await client.remove_image("image-abc") is False
    runtime.fail = BadRequest("template 'base' is not an imported image")
    with pytest.raises(BadRequest, match="not an imported image"):
        await client.remove_image("base")


async def test_calls_before_start_are_refused() -> None:
    remote = RemoteRuntime("http://127.0.0.1:1", TOKEN)
    with pytest.raises(RuntimeError, match="before start"):
        await remote.is_alive("x")


# errors ------------------------------------------------------------------------------------


class NodeFull(api_errors.Unavailable):
    """A node-side subclass the allow-list does not name."""


ERRORS: list[Exception] = [
    api_errors.Unavailable("no capacity: 3 starts queued", 7),
    api_errors.Unavailable("no capacity, no hint"),
    api_errors.TooManyRequests("team limit", 30),
    api_errors.InsufficientStorage("no space left in the data dir /var/lib/agentenv"),
    api_errors.BadRequest("memory_mb must be at least 128"),
    api_errors.SandboxNotFound("sb-404"),
    api_errors.SandboxLost("sb-410", "its VM died"),
    api_errors.TemplateNotFound("tpl", "template 'tpl' not found; known: base"),
    api_errors.Conflict("sandbox sb-1 is paused"),
    api_errors.NotSupported("no snapshots here"),
    api_errors.CreateFailed("envd never answered"),
    api_errors.OrchestratorError("plain"),
    rt.TemplateUnavailable("no template 'x' on this node"),
    rt.TagUnavailable("tag 'v2' names no ready build"),
    rt.Lost("sandbox sb-1 is gone: QEMU exited"),
    rt.GuestFailed("sandbox sb-1: the command did not run"),
    rt.Unsupported("pause needs snapshots"),
    rt.RuntimeFailure("generic runtime failure"),
]


@pytest.mark.parametrize("exc", ERRORS, ids=lambda e: f"{type(e).__name__}")
async def test_contract_errors_arrive_as_the_same_class(
    node: tuple[MemoryRuntime, NodeServer], client: RemoteRuntime, exc: Exception
) -> None:
    runtime, _ = node
    runtime.fail = exc
    with pytest.raises(Exception) as info:
        await client.create(full_spec())
    got = info.value
    assert type(got) is type(exc)
    assert str(got) == str(exc)
    if isinstance(exc, api_errors.OrchestratorError):
        assert isinstance(got, api_errors.OrchestratorError)
        assert got.message == exc.message
        assert got.retry_after == exc.retry_after
        assert got.status == exc.status
    for attr in ("sandbox_id", "name"):
        assert getattr(got, attr, None) == getattr(exc, attr, None)


def test_every_contract_error_class_is_tested() -> None:
    assert {type(e).__name__ for e in ERRORS} == set(KINDS)


async def test_an_unlisted_subclass_arrives_as_its_contract_class(
    node: tuple[MemoryRuntime, NodeServer], client: RemoteRuntime
) -> None:
    node[0].fail = NodeFull("out of slots", 11)
    with pytest.raises(api_errors.Unavailable) as info:
        await client.is_alive("x")
    assert type(info.value) is api_errors.Unavailable
    assert (info.value.message, info.value.retry_after) == ("out of slots", 11)


async def test_an_unknown_error_is_internal_with_its_message(
    node: tuple[MemoryRuntime, NodeServer],
    client: RemoteRuntime,
    caplog: pytest.LogCaptureFixture,
) -> None:
    node[0].fail = ZeroDivisionError("the node divided by zero")
    with (
        caplog.at_level(logging.ERROR, logger="agentenv.noderpc"),
        pytest.raises(NodeError) as info,
    ):
        await client.delete("sb-1")
    assert "the node divided by zero" in str(info.value)
    assert "ZeroDivisionError" in str(info.value)
    assert node[1].url in str(info.value)
    assert info.value.status == 500
    # Logged where it happened, with its traceback.
    logged = [r for r in caplog.records if r.exc_info and "delete failed" in r.getMessage()]
    assert logged, caplog.records


async def test_a_bad_egress_target_is_the_callers_error(
    node: tuple[MemoryRuntime, NodeServer], client: RemoteRuntime
) -> None:
    from agentenv.noderpc.gen import node_pb as pb

    assert client._rpc is not None
    req = pb.UpdateEgressRequest(
        sandbox_id="sb-1", egress=pb.Egress(internet=True, deny_out=["not a target!"])
    )
    with pytest.raises(Exception) as info:
        await client._rpc.update_egress(req, headers={"authorization": f"Bearer {TOKEN}"})
    assert "invalid_argument" in repr(getattr(info.value, "code", "")).lower()
    assert not [c for c in node[0].calls if c[0] == "update_egress"]


# authentication ------------------------------------------------------------------------------


async def test_wrong_token_is_refused_and_the_runtime_not_called(
    node: tuple[MemoryRuntime, NodeServer],
) -> None:
    runtime, server = node
    remote = RemoteRuntime(server.url, "not-the-token", config=FAST)
    await remote.start()
    try:
        with pytest.raises(NodeError, match="unauthenticated"):
            await remote.create(full_spec())
        with pytest.raises(NodeError, match="unauthenticated"):
            await remote.sandbox_ids()
        seen: list[tuple[str, str]] = []
        remote.watch_lost(lambda rid, why: seen.append((rid, why)))
        runtime.lose("sb-x", "gone")
        await asyncio.sleep(0.5)
        assert seen == []
    finally:
        await remote.close()
    assert runtime.calls == []


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"authorization": TOKEN},
        {"authorization": f"Bearer {TOKEN}x"},
        {"authorization": f"Basic {TOKEN}"},
        {"authorization": "Bearer"},
    ],
    ids=["missing", "no-scheme", "longer", "basic", "empty"],
)
async def test_requests_without_the_token_get_401(
    node: tuple[MemoryRuntime, NodeServer], headers: dict[str, str]
) -> None:
    runtime, server = node
    async with httpx.AsyncClient(timeout=5) as http:
        resp = await http.post(
            f"{server.url}/agentenv.node.v1.NodeService/SandboxIds",
            content=b"{}",
            headers={"content-type": "application/json", **headers},
        )
        assert resp.status_code == 401
        assert resp.json()["code"] == "unauthenticated"
        # The right token over the same raw route works (so the refusal is the token's).
        ok = await http.post(
            f"{server.url}/agentenv.node.v1.NodeService/SandboxIds",
            content=b"{}",
            headers={"content-type": "application/json", "authorization": f"Bearer {TOKEN}"},
        )
        assert ok.status_code == 200, ok.text
    assert runtime.calls == [("sandbox_ids", ())]


# dead and silent nodes ----------------------------------------------------------------------


async def test_node_killed_mid_call_raises_unreachable_within_the_deadline(
    subserver: Subserver,
) -> None:
    await subserver.start()
    config = NodeRpcConfig(query_s=5.0, change_s=5.0, long_s=20.0, connect_s=2.0)
    remote = RemoteRuntime(subserver.url, TOKEN, config=config)
    await remote.start()
    try:
        assert await remote.is_alive("x") is False
        call = asyncio.create_task(remote.create(full_spec(template="slow")))
        await asyncio.sleep(0.5)
        assert not call.done()
        started = time.monotonic()
        await subserver.kill()
        with pytest.raises(NodeUnreachable) as info:
            await call
        took = time.monotonic() - started
        print(f"\nSIGKILLed node mid-create: NodeUnreachable after {took * 1e3:.1f} ms")
        assert took < 5.0, took
        assert isinstance(info.value, api_errors.Unavailable)
        assert info.value.status == 503
        assert info.value.retry_after == config.retry_after_s
        assert subserver.url in info.value.message and "Create" in info.value.message
        # And a call to the dead node fails at once, the same way.
        started = time.monotonic()
        with pytest.raises(NodeUnreachable, match="unreachable"):
            await remote.is_alive("x")
        assert time.monotonic() - started < 3.0
    finally:
        await remote.close()


async def test_a_server_that_never_answers_hits_the_deadline() -> None:
    accepted: list[asyncio.StreamWriter] = []

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(writer)
        with contextlib.suppress(Exception):
            while await reader.read(65536):
                pass

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    remote = RemoteRuntime(
        f"http://127.0.0.1:{port}",
        TOKEN,
        config=NodeRpcConfig(query_s=1.0, change_s=1.0, long_s=1.5, connect_s=1.0),
    )
    await remote.start()
    try:
        for call, deadline in ((remote.is_alive("x"), 1.0), (remote.create(full_spec()), 1.5)):
            started = time.monotonic()
            with pytest.raises(NodeUnreachable, match="no answer within") as info:
                await call
            took = time.monotonic() - started
            print(f"\nsilent node, deadline {deadline} s: NodeUnreachable after {took:.2f} s")
            assert deadline - 0.1 < took < deadline + 1.5, took
            assert f"127.0.0.1:{port}" in str(info.value)
        assert accepted  # it did accept: this is the silent case, not a refused one
    finally:
        await remote.close()
        for writer in accepted:
            writer.close()
        server.close()
        await server.wait_closed()


async def test_a_call_an_older_node_lacks_is_unsupported() -> None:
    """A node agent of an older version answers a call it does not have with 404 (Connect:
    UNIMPLEMENTED): the caller gets `Unsupported`, and a reset falls back to delete + create."""
    answered: list[asyncio.StreamWriter] = []

    async def old_node(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        answered.append(writer)
        with contextlib.suppress(Exception):
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n")
            await writer.drain()

    server = await asyncio.start_server(old_node, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    remote = RemoteRuntime(f"http://127.0.0.1:{port}", TOKEN)
    await remote.start()
    try:
        with pytest.raises(rt.Unsupported, match="Reset is not implemented"):
            await remote.reset(full_spec())
    finally:
        await remote.close()
        for writer in answered:
            writer.close()
        server.close()
        await server.wait_closed()


async def test_the_node_gives_up_on_a_call_past_its_deadline(
    node: tuple[MemoryRuntime, NodeServer],
) -> None:
    runtime, server = node
    remote = RemoteRuntime(server.url, TOKEN, config=NodeRpcConfig(long_s=1.0))
    await remote.start()
    try:
        started = time.monotonic()
        with pytest.raises(NodeUnreachable, match="Create"):
            await remote.create(full_spec(template="hang"))
        assert time.monotonic() - started < 2.5
        # The server side cancelled the create when the deadline passed, so nothing keeps
        # running there for a caller that has gone.
        await wait_for(lambda: runtime.cancelled == ["sb-1"], 2)
        assert runtime.held == {}
    finally:
        await remote.close()


async def test_cancelling_a_call_cancels_it_on_the_node(
    node: tuple[MemoryRuntime, NodeServer], client: RemoteRuntime
) -> None:
    runtime, _ = node
    call = asyncio.create_task(client.create(full_spec(template="hang")))
    await wait_for(lambda: runtime.calls, 2)
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    # As in-process: the caller's cancellation reaches the runtime's call (the connection
    # closes; the server cancels what it was running for it).
    await wait_for(lambda: runtime.cancelled == ["sb-1"], 2)
    # The client is still usable.
    assert await client.is_alive("sb-1") is False


# lost events ---------------------------------------------------------------------------------


async def wait_for(predicate: Callable[[], object], within_s: float) -> None:
    """Polls: the tests' runtime and handlers are plain lists, not awaitables."""
    async with asyncio.timeout(within_s):
        while not predicate():  # noqa: ASYNC110
            await asyncio.sleep(0.02)


async def test_watch_lost_delivers_events(
    node: tuple[MemoryRuntime, NodeServer], client: RemoteRuntime
) -> None:
    runtime, _ = node
    seen: list[tuple[str, str]] = []
    client.watch_lost(lambda rid, why: seen.append((rid, why)))
    await client.create(full_spec("doomed-1", template="doomed"))
    await wait_for(lambda: seen, 5)
    assert seen == [("doomed-1", "VM exited with status 137")]
    # Several at once, in order, each once (heartbeats are not events).
    for i in range(5):
        runtime.lose(f"sb-{i}", f"why {i}")
    await wait_for(lambda: len(seen) == 6, 5)
    await asyncio.sleep(0.6)  # a few heartbeats
    assert seen[1:] == [(f"sb-{i}", f"why {i}") for i in range(5)]


async def test_events_before_the_client_connects_are_delivered(
    node: tuple[MemoryRuntime, NodeServer],
) -> None:
    runtime, server = node
    runtime.lose("early", "died before anyone watched")
    remote = RemoteRuntime(server.url, TOKEN, config=FAST)
    seen: list[tuple[str, str]] = []
    remote.watch_lost(lambda rid, why: seen.append((rid, why)))
    await remote.start()
    try:
        await wait_for(lambda: seen, 5)
        assert seen == [("early", "died before anyone watched")]
    finally:
        await remote.close()


async def test_watch_lost_reconnects_after_the_node_restarts(subserver: Subserver) -> None:
    await subserver.start()
    remote = RemoteRuntime(subserver.url, TOKEN, config=FAST, watch_silence_s=2.0)
    seen: list[tuple[str, str]] = []
    remote.watch_lost(lambda rid, why: seen.append((rid, why)))
    await remote.start()
    try:
        await remote.create(full_spec("doomed-a", template="doomed"))
        await wait_for(lambda: len(seen) == 1, 5)
        await subserver.kill()
        await asyncio.sleep(1.0)  # the stream breaks; the client retries with backoff
        await subserver.start()
        await remote.create(full_spec("doomed-b", template="doomed"))
        await wait_for(lambda: len(seen) == 2, 15)
        assert [rid for rid, _ in seen] == ["doomed-a", "doomed-b"]
    finally:
        await remote.close()


async def test_a_silent_stream_is_dropped_and_reopened(subserver: Subserver) -> None:
    """A stopped node (no FIN, no RST) looks like a quiet one until heartbeats stop."""
    await subserver.start()
    assert subserver.proc is not None
    remote = RemoteRuntime(subserver.url, TOKEN, config=FAST, watch_silence_s=1.5)
    seen: list[tuple[str, str]] = []
    remote.watch_lost(lambda rid, why: seen.append((rid, why)))
    await remote.start()
    try:
        await asyncio.sleep(0.5)
        subserver.proc.send_signal(signal.SIGSTOP)
        await asyncio.sleep(3.0)  # past the silence limit: the client dropped the stream
        subserver.proc.send_signal(signal.SIGCONT)
        await remote.create(full_spec("doomed-c", template="doomed"))
        await wait_for(lambda: seen, 15)
        assert seen == [("doomed-c", "VM exited with status 137")]
    finally:
        if subserver.proc.returncode is None:
            subserver.proc.send_signal(signal.SIGCONT)
        await remote.close()


async def test_close_stops_background_tasks(node: tuple[MemoryRuntime, NodeServer]) -> None:
    remote = RemoteRuntime(node[1].url, TOKEN, config=FAST)
    remote.watch_lost(lambda rid, why: None)
    await remote.start()
    remote.note_activity("sb-1")
    await asyncio.sleep(0.3)
    mine = {remote._watch_task, remote._activity_task}
    assert all(t is not None and not t.done() for t in mine)
    await remote.close()
    assert all(t is not None and t.done() for t in mine)
    with pytest.raises(RuntimeError):
        await remote.is_alive("sb-1")


# load ----------------------------------------------------------------------------------------


async def test_200_concurrent_calls(
    node: tuple[MemoryRuntime, NodeServer], client: RemoteRuntime
) -> None:
    runtime, _ = node
    specs = [SandboxSpec(f"c-{i}", "base", 1, 512, metadata={"i": str(i)}) for i in range(100)]
    started = time.perf_counter()
    results = await asyncio.gather(
        *(client.create(s) for s in specs), *(client.is_alive(f"c-{i}") for i in range(100))
    )
    took = time.perf_counter() - started
    assert results[:100] == [runtime.placement(s.sandbox_id) for s in specs]
    assert all(isinstance(r, bool) for r in results[100:])
    assert len(runtime.held) == 100
    print(f"\n200 concurrent calls (100 create + 100 is_alive): {took * 1e3:.0f} ms")


async def test_note_activity_never_waits_and_arrives_batched(
    node: tuple[MemoryRuntime, NodeServer],
    client: RemoteRuntime,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    runtime, _ = node
    batches: list[int] = []
    real = client._note

    async def counted(batch: list[str]) -> None:
        batches.append(len(batch))
        await real(batch)

    monkeypatch.setattr(client, "_note", counted)
    ids = [f"sb-{i}" for i in range(10_000)]
    started = time.perf_counter()
    for rid in ids:
        client.note_activity(rid)
    took = time.perf_counter() - started
    assert took < 0.1, took
    await wait_for(lambda: len(runtime.activity) >= 10_000, 10)
    assert sorted(runtime.activity) == sorted(ids)
    assert sum(batches) == 10_000
    assert len(batches) <= 10, batches
    print(f"\nnote_activity: 10000 ids queued in {took * 1e3:.1f} ms, sent in {len(batches)} calls")


async def test_note_activity_is_bounded_and_drops_the_oldest(
    node: tuple[MemoryRuntime, NodeServer],
) -> None:
    runtime, server = node
    remote = RemoteRuntime(server.url, TOKEN, config=FAST)
    over = node_streams.ACTIVITY_PENDING_MAX + 5
    for i in range(over):  # not started: nothing is sent, the queue only fills
        remote.note_activity(f"sb-{i}")
    remote.note_activity("sb-10")  # already queued: not twice
    assert remote.activity_dropped == 5
    await remote.start()
    try:
        await wait_for(lambda: len(runtime.activity) >= node_streams.ACTIVITY_PENDING_MAX, 10)
        assert sorted(runtime.activity) == sorted(f"sb-{i}" for i in range(5, over))
    finally:
        await remote.close()


async def test_loopback_latency_per_call(
    node: tuple[MemoryRuntime, NodeServer], client: RemoteRuntime
) -> None:
    for _ in range(50):  # warm the connection pool
        await client.is_alive("x")
    samples: list[float] = []
    for _ in range(2000):
        started = time.perf_counter()
        await client.is_alive("x")
        samples.append(time.perf_counter() - started)
    samples.sort()
    p50 = statistics.median(samples) * 1e3
    p99 = samples[int(len(samples) * 0.99)] * 1e3
    # The same call in-process, for the added cost.
    direct: list[float] = []
    for _ in range(2000):
        started = time.perf_counter()
        await node[0].is_alive("x")
        direct.append(time.perf_counter() - started)
    direct_p50 = statistics.median(direct) * 1e3
    print(
        f"\nnode RPC loopback, trivial call (is_alive), 2000 sequential: p50 {p50:.3f} ms, "
        f"p99 {p99:.3f} ms (in-process p50 {direct_p50:.4f} ms); cpus={os.cpu_count()}"
    )
    assert p99 < 50, (p50, p99)


async def test_proxy_variables_do_not_apply(
    node: tuple[MemoryRuntime, NodeServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Nothing listens on port 9: a request sent through this "proxy" would fail.
    for name in ("HTTP_PROXY", "http_proxy", "HTTPS_PROXY", "https_proxy", "ALL_PROXY"):
        monkeypatch.setenv(name, "http://127.0.0.1:9")
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    for url in (node[1].url, node[1].url.replace("127.0.0.1", "localhost")):
        remote = RemoteRuntime(url, TOKEN, config=FAST)
        await remote.start()
        try:
            assert await remote.sandbox_ids() == []
        finally:
            await remote.close()
