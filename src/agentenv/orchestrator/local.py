"""Host-process sandboxes: envd runs as a plain process on its own loopback address.

No isolation at all: this runtime exists for development and for exercising the control plane
and proxy against a real envd without booting VMs (`aenv serve --runtime local`). Each sandbox
gets an address in 127.77.0.0/16 so, like a slot address, every port of the "sandbox" is
reachable at ``address:port``.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from agentenv.config import ENVD_PORT
from agentenv.orchestrator.runtime import (
    Placement,
    RuntimeFailure,
    TemplateInfo,
    TemplateUnavailable,
    Unsupported,
)

_NET = ipaddress.IPv4Network("127.77.0.0/16")
_READY_TIMEOUT_S = 30.0


@dataclass
class _Proc:
    process: asyncio.subprocess.Process
    address: str
    workdir: Path


class LocalRuntime:
    def __init__(self, workdir: Path, *, default_user: str | None = None) -> None:
        self.workdir = workdir
        self.default_user = default_user
        self._procs: dict[str, _Proc] = {}
        self._next = 2

    async def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)

    async def close(self) -> None:
        for runtime_id in list(self._procs):
            await self.delete(runtime_id)

    def _address(self) -> str:
        used = {p.address for p in self._procs.values()}
        for _ in range(_NET.num_addresses):
            candidate = str(_NET.network_address + self._next)
            self._next = self._next + 1 if self._next < _NET.num_addresses - 2 else 2
            if candidate not in used:
                return candidate
        raise RuntimeFailure("no free loopback address for a local sandbox")

    async def create(self, template: str, cpu: int, memory_mb: int, disk_size_mb: int) -> Placement:
        address = self._address()
        runtime_id = "local-" + address.replace(".", "-")
        workdir = self.workdir / runtime_id
        workdir.mkdir(parents=True, exist_ok=True)
        args = [
            sys.executable,
            "-m",
            "agentenv.guest.envd",
            "--host",
            address,
            "--port",
            str(ENVD_PORT),
        ]
        if self.default_user:
            args += ["--default-user", self.default_user]
        log_fd = os.open(workdir / "envd.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            process = await asyncio.create_subprocess_exec(
                *args,
                cwd=workdir,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=log_fd,
                stderr=log_fd,
                start_new_session=True,
            )
        finally:
            os.close(log_fd)
        self._procs[runtime_id] = _Proc(process, address, workdir)
        envd_url = f"http://{address}:{ENVD_PORT}"
        try:
            await _wait_ready(envd_url, process)
        except BaseException:
            await self.delete(runtime_id)
            raise
        return Placement(runtime_id, address, envd_url)

    async def delete(self, runtime_id: str) -> None:
        proc = self._procs.pop(runtime_id, None)
        if proc is None:
            return
        p = proc.process
        if p.returncode is None:
            # envd and every command it started share the session we created for it.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
            try:
                await asyncio.wait_for(p.wait(), timeout=5)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                await p.wait()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)

    async def pause(self, runtime_id: str) -> None:
        raise Unsupported("pause needs memory snapshots, which the local runtime cannot take")

    async def resume(self, runtime_id: str) -> Placement:
        raise Unsupported("resume needs memory snapshots, which the local runtime cannot take")

    def is_alive(self, runtime_id: str) -> bool:
        proc = self._procs.get(runtime_id)
        return proc is not None and proc.process.returncode is None


async def _wait_ready(envd_url: str, process: asyncio.subprocess.Process) -> None:
    deadline = time.monotonic() + _READY_TIMEOUT_S
    async with httpx.AsyncClient(timeout=2.0, trust_env=False) as client:
        while time.monotonic() < deadline:
            if process.returncode is not None:
                raise RuntimeFailure(f"envd exited with code {process.returncode} during start")
            with contextlib.suppress(httpx.TransportError):
                resp = await client.get(f"{envd_url}/health")
                if resp.status_code < 300:
                    return
            await asyncio.sleep(0.05)
    raise RuntimeFailure(f"envd at {envd_url} not ready after {_READY_TIMEOUT_S:.0f} s")


class StaticTemplates:
    """Template names for runtimes that do not build images (the local runtime)."""

    def __init__(self, names: list[str], *, cpu: int = 1, memory_mb: int = 512) -> None:
        now = time.time()
        self._items = {
            n: TemplateInfo(
                n, size_mb=1024, created_at=now, updated_at=now, cpu=cpu, memory_mb=memory_mb
            )
            for n in names
        }

    def get(self, name: str) -> TemplateInfo:
        try:
            return self._items[name]
        except KeyError:
            raise TemplateUnavailable(name) from None

    def list(self) -> list[TemplateInfo]:
        return list(self._items.values())

    def delete(self, name: str) -> bool:
        return self._items.pop(name, None) is not None
