"""Small helpers shared by the envd tests: building requests and reading process streams."""

from __future__ import annotations

import asyncio
import json
import struct
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from protobuf import Oneof

from agentenv.guest.envd.gen.process import process_pb as pb
from agentenv.guest.envd.gen.process.process_connect import ProcessClient

ENVELOPE = struct.Struct(">BI")


def bash(
    cmd: str,
    *,
    envs: Mapping[str, str] | None = None,
    cwd: str | None = None,
    stdin: bool | None = False,
    tag: str | None = None,
    pty: tuple[int, int] | None = None,
) -> pb.StartRequest:
    config = pb.ProcessConfig(
        cmd="/bin/bash", args=["-l", "-c", cmd], envs=dict(envs or {}), cwd=cwd
    )
    size = pb.PTY(size=pb.PTY.Size(cols=pty[0], rows=pty[1])) if pty else None
    return pb.StartRequest(process=config, stdin=stdin, tag=tag, pty=size)


@dataclass
class Run:
    pid: int = 0
    stdout: bytearray = field(default_factory=bytearray)
    stderr: bytearray = field(default_factory=bytearray)
    pty: bytearray = field(default_factory=bytearray)
    end: pb.ProcessEvent.EndEvent | None = None
    kinds: list[str] = field(default_factory=list)


async def consume(stream: AsyncIterator[Any], run: Run | None = None) -> Run:
    """Reads a Start/Connect stream to its end."""
    run = run or Run()
    async for response in stream:
        event = response.event.event
        run.kinds.append(event.field)
        if event.field == "start":
            run.pid = event.value.pid
        elif event.field == "data":
            output = event.value.output
            getattr(run, output.field).extend(output.value)
        elif event.field == "end":
            run.end = event.value
    return run


async def run_cmd(client: ProcessClient, request: pb.StartRequest, **kwargs: Any) -> Run:
    return await consume(client.start(request, **kwargs))


def selector(pid: int) -> pb.ProcessSelector:
    return pb.ProcessSelector(selector=Oneof("pid", pid))


def tag_selector(tag: str) -> pb.ProcessSelector:
    return pb.ProcessSelector(selector=Oneof("tag", tag))


async def listed_pids(client: ProcessClient) -> set[int]:
    response = await client.list(pb.ListRequest())
    return {p.pid for p in response.processes}


async def wait_gone(client: ProcessClient, pid: int, seconds: float = 10) -> None:
    for _ in range(int(seconds / 0.05)):
        if pid not in await listed_pids(client):
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"pid {pid} still listed after {seconds}s")


def envelope(message: Mapping[str, Any], flags: int = 0) -> bytes:
    body = json.dumps(message).encode()
    return ENVELOPE.pack(flags, len(body)) + body


class FrameReader:
    """Splits a raw Connect streaming body into (flags, json) frames, counting bytes only."""

    def __init__(self) -> None:
        self.buf = bytearray()

    def feed(self, chunk: bytes) -> list[tuple[int, bytes]]:
        self.buf += chunk
        frames = []
        while len(self.buf) >= ENVELOPE.size:
            flags, size = ENVELOPE.unpack_from(self.buf)
            if len(self.buf) < ENVELOPE.size + size:
                break
            frames.append((flags, bytes(self.buf[ENVELOPE.size : ENVELOPE.size + size])))
            del self.buf[: ENVELOPE.size + size]
        return frames


STREAM_HEADERS = {
    "content-type": "application/connect+json",
    "connect-protocol-version": "1",
}
UNARY_HEADERS = {"content-type": "application/json", "connect-protocol-version": "1"}
