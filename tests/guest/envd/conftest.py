"""Fixtures: envd as a real subprocess on a free loopback port, a `user` account, clients."""

from __future__ import annotations

import base64
import contextlib
import os
import pwd
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from connectrpc.codec import proto_json_codec

from agentenv.guest.envd.gen.filesystem.filesystem_connect import FilesystemClient
from agentenv.guest.envd.gen.process.process_connect import ProcessClient


@pytest.fixture(scope="session")
def sandbox_user() -> Iterator[str]:
    """The E2B default user; created for the session if this host lacks it."""
    created = False
    try:
        pwd.getpwnam("user")
    except KeyError:
        subprocess.run(["useradd", "-m", "-s", "/bin/bash", "user"], check=True)
        created = True
    yield "user"
    if created:
        subprocess.run(["userdel", "-r", "user"], check=False, capture_output=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class EnvdProc:
    proc: subprocess.Popen[bytes]
    port: int
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        return self.proc.pid

    def rss_mib(self) -> float:
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        raise AssertionError("no VmRSS")

    def fds(self) -> list[str]:
        fd_dir = Path(f"/proc/{self.pid}/fd")
        found = []
        for entry in fd_dir.iterdir():
            with contextlib.suppress(FileNotFoundError):
                found.append(os.readlink(entry))
        return found

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


def start_envd(tmp: Path, *extra: str) -> EnvdProc:
    port = free_port()
    log = tmp / f"envd-{port}.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "agentenv.guest.envd",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--default-user",
                "user",
                *extra,
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    handle = EnvdProc(proc, port, log)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"envd exited early:\n{log.read_text()}")
        try:
            if httpx.get(handle.url + "/health", timeout=1).status_code == 204:
                return handle
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    handle.stop()
    raise AssertionError(f"envd did not become healthy:\n{log.read_text()}")


@pytest.fixture(scope="module")
def envd(sandbox_user: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EnvdProc]:
    handle = start_envd(tmp_path_factory.mktemp("envd"))
    yield handle
    handle.stop()
    assert handle.proc.returncode is not None


@pytest.fixture
def fresh_envd(sandbox_user: str, tmp_path: Path) -> Iterator[EnvdProc]:
    """An envd of its own, for tests that change its state (tokens, defaults)."""
    handle = start_envd(tmp_path)
    yield handle
    handle.stop()


def basic(user: str) -> dict[str, str]:
    return {"Authorization": "Basic " + base64.b64encode(f"{user}:".encode()).decode()}


@pytest.fixture
async def process_client(envd: EnvdProc) -> AsyncIterator[ProcessClient]:
    async with ProcessClient(envd.url, codec=proto_json_codec(), send_compression=None) as client:
        yield client


@pytest.fixture
async def fs_client(envd: EnvdProc) -> AsyncIterator[FilesystemClient]:
    async with FilesystemClient(
        envd.url, codec=proto_json_codec(), send_compression=None
    ) as client:
        yield client


@pytest.fixture
async def http(envd: EnvdProc) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=envd.url, timeout=60) as client:
        yield client


@pytest.fixture
def user_home(sandbox_user: str) -> Path:
    return Path(pwd.getpwnam(sandbox_user).pw_dir)


@pytest.fixture
def scratch(user_home: Path) -> Iterator[Path]:
    """A fresh directory in the user's home, owned by the user, removed afterwards."""
    path = user_home / f"envd-test-{os.getpid()}-{time.monotonic_ns()}"
    path.mkdir()
    pw = pwd.getpwnam("user")
    os.chown(path, pw.pw_uid, pw.pw_gid)
    yield path
    subprocess.run(["rm", "-rf", str(path)], check=False)
