"""A build's work inside its sandbox, through the `Runtime` contract's guest calls (the
node runs them through the sandbox's envd, in-process or over the node RPC): RUN and COPY
steps, the shell WORKDIR needs, and the start of the template (envd's defaults, the start
command, the ready check). The one place the builder talks to a guest; `builder.Builder`
decides what runs. A guest call the runtime could not make (`RuntimeFailure`, or the
sandbox gone) fails the step it belongs to.
"""

from __future__ import annotations

import asyncio
import os
import shlex
import time
from collections.abc import Callable
from pathlib import Path

from agentenv.build.spec import BuildSpec, Step
from agentenv.build.state import BuildRecord, BuildStore
from agentenv.build.steps import Context, StepFailed, copy_script, describe, join_path
from agentenv.contract.errors import OrchestratorError
from agentenv.contract.runtime import (
    GUEST_WRITE_MAX_BYTES,
    GuestCommand,
    Runtime,
    RuntimeFailure,
)
from agentenv.control.store import SandboxRecord

STEP_TIMEOUT_S = float(os.environ.get("AGENTENV_BUILD_STEP_TIMEOUT_S", "3600"))
READY_TIMEOUT_S = float(os.environ.get("AGENTENV_BUILD_READY_TIMEOUT_S", "300"))
READY_POLL_S = 1.0
START_LOG = "/tmp/.agentenv-start.log"
TAIL_LINES = 20
# What a guest call may fail with, as the contract types it.
GUEST_ERRORS = (RuntimeFailure, OrchestratorError)


class GuestSteps:
    """Runs a build's commands in its sandbox; their output goes to the build's log."""

    def __init__(self, state: BuildStore, runtime: Runtime) -> None:
        self.state = state
        self.runtime = runtime

    def _log(self, rec: BuildRecord, step: str | None) -> Callable[[str, str], None]:
        def emit(line: str, stream: str) -> None:
            self.state.log(rec.build_id, line, "info" if stream == "stdout" else "warn", step)

        return emit

    async def sh(
        self,
        rec: BuildRecord,
        sandbox: SandboxRecord,
        cmd: str,
        label: str,
        *,
        user: str = "root",
        envs: dict[str, str] | None = None,
        cwd: str | None = None,
        quiet: bool = False,
    ) -> int:
        emit = (lambda _l, _s: None) if quiet else self._log(rec, label)
        command = GuestCommand(cmd, user=user, envs=envs or {}, cwd=cwd, timeout_s=STEP_TIMEOUT_S)
        try:
            return await self.runtime.guest_run(sandbox.id, sandbox.envd_token, command, emit)
        except GUEST_ERRORS as exc:
            raise StepFailed(label, f"step {label}: the command could not run: {exc}") from exc

    async def run_step(
        self, rec: BuildRecord, sandbox: SandboxRecord, step: Step, ctx: Context, label: str
    ) -> None:
        user = step.args[1] if len(step.args) > 1 and step.args[1] else ctx.user
        code = await self.sh(
            rec, sandbox, step.args[0], label, user=user, envs=ctx.envs, cwd=ctx.workdir
        )
        if code != 0:
            raise StepFailed(label, f"step {label} ({describe(step)}) failed with exit code {code}")

    async def copy_step(
        self, rec: BuildRecord, sandbox: SandboxRecord, step: Step, ctx: Context, label: str
    ) -> None:
        assert step.files_hash is not None
        local = await self.state.files(step.files_hash)
        if local is None:
            raise StepFailed(label, f"step {label}: files {step.files_hash} were not uploaded")
        staging = f"/tmp/.agentenv-copy-{step.files_hash[:16]}.tar"
        try:
            await self.upload(sandbox, local, staging)
        except GUEST_ERRORS as exc:
            msg = f"step {label}: the files did not reach the sandbox: {exc}"
            raise StepFailed(label, msg) from exc
        dest = join_path(ctx.workdir, step.args[1]) + ("/" if step.args[1].endswith("/") else "")
        owner = step.args[2] if len(step.args) > 2 and step.args[2] else ctx.user
        mode = step.args[3] if len(step.args) > 3 else ""
        code = await self.sh(
            rec, sandbox, copy_script(step.args[0], dest, owner, mode, staging), label
        )
        if code != 0:
            raise StepFailed(label, f"step {label} ({describe(step)}) failed with exit code {code}")

    async def upload(self, sandbox: SandboxRecord, local: Path, dest: str) -> None:
        """The host file `local` to `dest` in the sandbox, in pieces the contract takes."""
        append = False
        with local.open("rb") as f:
            while True:
                piece = await asyncio.to_thread(f.read, GUEST_WRITE_MAX_BYTES)
                if not piece and append:
                    return
                await self.runtime.guest_write(
                    sandbox.id, sandbox.envd_token, dest, piece, append=append
                )
                if len(piece) < GUEST_WRITE_MAX_BYTES:
                    return
                append = True

    async def start(
        self, rec: BuildRecord, sandbox: SandboxRecord, spec: BuildSpec, ctx: Context
    ) -> None:
        bid = rec.build_id
        # The last USER/WORKDIR are the sandbox's defaults, as in E2B; envd keeps them in the
        # snapshot's memory.
        try:
            await self.runtime.guest_defaults(sandbox.id, sandbox.envd_token, ctx.user, ctx.workdir)
        except GUEST_ERRORS as exc:
            raise StepFailed("finalize", f"envd /init failed: {exc}") from exc
        if spec.start_cmd:
            self.state.log(bid, f"Starting: {spec.start_cmd}", step="finalize")
            # No terminal, so no hangup to survive: a plain background job outlives the
            # shell (envd does not kill a finished command's process group). No `nohup`:
            # a busybox image may not have it.
            bg = f"/bin/sh -c {shlex.quote(spec.start_cmd)} > {START_LOG} 2>&1 < /dev/null &"
            code = await self.sh(
                rec, sandbox, bg, "finalize", user=ctx.user, envs=ctx.envs, cwd=ctx.workdir
            )
            if code != 0:
                raise StepFailed("finalize", f"startCmd could not be started (exit {code})")
        if spec.ready_cmd:
            await self.wait_ready(rec, sandbox, spec.ready_cmd, ctx)

    async def wait_ready(
        self, rec: BuildRecord, sandbox: SandboxRecord, ready_cmd: str, ctx: Context
    ) -> None:
        self.state.log(rec.build_id, f"Waiting for readyCmd: {ready_cmd}", step="finalize")
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            code = await self.sh(
                rec,
                sandbox,
                ready_cmd,
                "finalize",
                user=ctx.user,
                envs=ctx.envs,
                cwd=ctx.workdir,
                quiet=True,
            )
            if code == 0:
                self.state.log(rec.build_id, "readyCmd succeeded", step="finalize")
                return
            if time.monotonic() >= deadline:
                break
            await asyncio.sleep(READY_POLL_S)
        await self.sh(rec, sandbox, f"tail -n {TAIL_LINES} {START_LOG} 2>/dev/null", "finalize")
        raise StepFailed(
            "finalize",
            f"readyCmd {ready_cmd!r} did not succeed within {READY_TIMEOUT_S:.0f}s",
        )
