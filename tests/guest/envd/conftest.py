"""Fixtures: envd as a real subprocess on a free loopback port, a `user` account, clients."""

from __future__ import annotations

import base64
import contextlib
import fcntl
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

# Host-wide, across the workers of a run (and other runs): the user is made by the first
# worker that needs it and removed by the last one done with it, never under another's tests.
# Each worker holds a shared lock on USERS_LOCK while it uses the account; whoever can take it
# exclusively (under USER_MUTEX) is the last one. CREATED says a test run made the account.
USER_MUTEX = Path("/run/agentenv-test-user.lock")
USERS_LOCK = Path("/run/agentenv-test-user.users")
USER_CREATED = Path("/run/agentenv-test-user.created")


@contextlib.contextmanager
def _locked(path: Path, how: int) -> Iterator[int]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, how)
        yield fd
    finally:
        os.close(fd)


@pytest.fixture(scope="session")
def sandbox_user() -> Iterator[str]:
    """The E2B default user; created for the run if this host lacks it."""
    users = os.open(USERS_LOCK, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(users, fcntl.LOCK_SH)  # waits out a last user's removal of the account
        with _locked(USER_MUTEX, fcntl.LOCK_EX):
            try:
                pwd.getpwnam("user")
            except KeyError:
                subprocess.run(["useradd", "-m", "-s", "/bin/bash", "user"], check=True)
                USER_CREATED.touch()
        yield "user"
    finally:
        os.close(users)  # our shared lock goes with it
    with _locked(USER_MUTEX, fcntl.LOCK_EX):
        try:
            with _locked(USERS_LOCK, fcntl.LOCK_EX | fcntl.LOCK_NB):
                if USER_CREATED.exists():
                    subprocess.run(["userdel", "-r", "user"], check=False, capture_output=True)
                    USER_CREATED.unlink()
        except BlockingIOError:
            pass  # another worker still uses it: the last one removes it


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
