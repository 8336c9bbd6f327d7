"""The `Runtime` contract's calls into a running guest (`guest_run`, `guest_write`,
`guest_defaults`): what a template build does in its build sandbox, through that sandbox's
envd on this node. Split from `runtime.py`; `NodeRuntime` is built over it.

envd's failures leave here as the contract's `GuestFailed`; a sandbox this node does not run
is `SandboxNotFound`. A client per call: a killed sandbox's slot address goes to the next
sandbox, and a pooled connection to the old VM there would break the new one's first call.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shlex
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

from agentenv.contract.errors import SandboxNotFound
from agentenv.contract.runtime import GUEST_WRITE_MAX_BYTES, GuestCommand, GuestFailed
from agentenv.guest.envd.client import EnvdClient, EnvdError
from agentenv.node.host import Node, SandboxHandle

# Deadline of the small envd calls around a write (the append's `cat`, `/init`).
GUEST_CALL_S = 60.0


@contextlib.contextmanager
def _guest_failures(sandbox_id: str, what: str) -> Iterator[None]:
    try:
        yield
    except EnvdError as exc:
        raise GuestFailed(f"sandbox {sandbox_id}: {what}: {exc}") from exc


class GuestCalls:
    node: Node

    def _running(self, sandbox_id: str) -> SandboxHandle:
        sb = self.node.running(sandbox_id)
        if sb is None:
            raise SandboxNotFound(sandbox_id)
        return sb

    async def guest_run(
        self,
        sandbox_id: str,
        envd_token: str | None,
        command: GuestCommand,
        on_line: Callable[[str, str], None],
    ) -> int:
        sb = self._running(sandbox_id)
        with _guest_failures(sandbox_id, "the command did not run to its end"):
            async with EnvdClient(sb.envd_url, envd_token) as envd:
                return await envd.run_streamed(
                    command.cmd,
                    user=command.user,
                    on_line=on_line,
                    envs=command.envs,
                    cwd=command.cwd,
                    timeout_s=command.timeout_s,
                )

    async def guest_write(
        self, sandbox_id: str, envd_token: str | None, path: str, data: bytes, *, append: bool
    ) -> None:
        if len(data) > GUEST_WRITE_MAX_BYTES:
            raise GuestFailed(
                f"sandbox {sandbox_id}: a write of {len(data)} bytes "
                f"(at most {GUEST_WRITE_MAX_BYTES} per call)"
            )
        sb = self._running(sandbox_id)
        local = await asyncio.to_thread(_spool, data)
        try:
            # envd's upload replaces a file: an append lands beside it and is added by `cat`.
            dest = f"{path}.part" if append else path
            with _guest_failures(sandbox_id, f"write {path}"):
                async with EnvdClient(sb.envd_url, envd_token) as envd:
                    await envd.upload_file(local, dest)
                    if append:
                        q, part = shlex.quote(path), shlex.quote(dest)
                        res = await envd.run(
                            f"cat {part} >> {q} && rm -f {part}",
                            "root",
                            GUEST_CALL_S,
                            shell="/bin/sh",
                        )
                        if res.exit_code != 0:
                            raise GuestFailed(
                                f"sandbox {sandbox_id}: append to {path}: {res.stderr.strip()}"
                            )
        finally:
            await asyncio.to_thread(local.unlink, missing_ok=True)

    async def guest_defaults(
        self, sandbox_id: str, envd_token: str | None, user: str, workdir: str
    ) -> None:
        sb = self._running(sandbox_id)
        with _guest_failures(sandbox_id, "envd /init"):
            async with EnvdClient(sb.envd_url, envd_token, timeout=GUEST_CALL_S) as envd:
                await envd.init(default_user=user, default_workdir=workdir)


def _spool(data: bytes) -> Path:
    fd, name = tempfile.mkstemp(prefix="agentenv-guest-write-")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    return Path(name)
