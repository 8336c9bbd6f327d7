"""One context: one Jupyter kernel, driven directly over ZMQ with jupyter_client.

Why no Jupyter server: the server only adds a REST/WebSocket hop between us and the kernel's
ZMQ sockets; jupyter_client talks to them directly, which is one process less to start before the
snapshot and one port less.

Snapshot safety (pause/resume and fork copy the whole guest memory, and the clock jumps on
resume): ZMQ binds 127.0.0.1 only; no heartbeat channel is started and no restarter runs, so
nothing decides a kernel is dead because time passed. A kernel is declared dead only when its
process is gone (checked while an execution waits).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from jupyter_client.asynchronous.client import AsyncKernelClient
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import AsyncKernelManager

from . import envs, messages
from .messages import Line

log = logging.getLogger(__name__)

# Set and unset by the warm-up (`Kernel.warm_up`), only to run the env-var snippet once.
WARM_UP_VAR = "AGENTENV_WARM_UP"


@dataclass
class Settings:
    """Server-wide knobs every kernel shares (set from the command line)."""

    envd_url: str = "http://127.0.0.1:49983"
    keepalive: float = 5.0
    start_timeout: float = 120.0
    envd_timeout: float = 5.0
    snippet_timeout: float = 30.0
    runtime_dir: str = ""  # the server makes (and removes) a private one
    default_cwd: str = "/home/user"


@dataclass
class _Pending:
    """One execute_request in flight: its output queue and whether it has finished."""

    queue: asyncio.Queue[Line | None] = field(default_factory=asyncio.Queue)
    done: asyncio.Event = field(default_factory=asyncio.Event)
    replied: bool = False
    idle: bool = False
    errored: bool = False

    def finish(self) -> None:
        if not self.done.is_set():
            self.done.set()
            self.queue.put_nowait(None)


class KernelGone(Exception):
    """The kernel's process died or could not be started."""


class Kernel:
    """A context: an id, a language, a cwd and the kernel behind them."""

    def __init__(
        self, language: str, cwd: str, spec_name: str, ksm: KernelSpecManager, settings: Settings
    ) -> None:
        self.id = str(uuid.uuid4())
        self.language = language
        self.cwd = cwd
        self._spec_name = spec_name
        self._ksm = ksm
        self._settings = settings
        self._km: AsyncKernelManager | None = None
        self._kc: AsyncKernelClient | None = None
        self._readers: list[asyncio.Task[None]] = []
        self._pending: dict[str, _Pending] = {}
        self._lock = asyncio.Lock()
        self._tail: asyncio.Task[None] | None = None
        self._sandbox_envs: dict[str, str] | None = None
        self._start_env: dict[str, str] = {}

    def describe(self) -> dict[str, str]:
        return {"id": self.id, "language": self.language, "cwd": self.cwd}

    # lifecycle ----------------------------------------------------------------------------

    async def start(self) -> None:
        """Start the kernel process in `cwd` and wait until it answers kernel_info."""
        env = dict(os.environ)
        env.setdefault("MPLBACKEND", "module://matplotlib_inline.backend_inline")
        env.setdefault("PYTHONUNBUFFERED", "1")
        env.pop("JPY_PARENT_PID", None)
        self._start_env = env
        km = AsyncKernelManager(
            kernel_name=self._spec_name,
            kernel_spec_manager=self._ksm,
            ip="127.0.0.1",
            transport="tcp",
            connection_file=os.path.join(self._settings.runtime_dir, f"kernel-{self.id}.json"),
        )
        self._km = km
        try:
            await asyncio.wait_for(
                km.start_kernel(cwd=self.cwd, env=env), self._settings.start_timeout
            )
            await self._connect()
        except Exception as exc:
            await self._kill()
            raise KernelGone(f"{self.language} kernel did not start: {exc!r}") from exc

    async def _connect(self) -> None:
        assert self._km is not None
        kc = self._km.client()
        kc.start_channels(shell=True, iopub=True, stdin=False, hb=False, control=False)
        self._kc = kc
        await asyncio.wait_for(
            kc._async_wait_for_ready(timeout=self._settings.start_timeout),
            self._settings.start_timeout + 5,
        )
        self._readers = [
            asyncio.create_task(self._read(kc, iopub=True), name=f"iopub-{self.id}"),
            asyncio.create_task(self._read(kc, iopub=False), name=f"shell-{self.id}"),
        ]

    async def _disconnect(self) -> None:
        for task in self._readers:
            task.cancel()
        for task in self._readers:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._readers = []
        if self._kc is not None:
            self._kc.stop_channels()
            self._kc = None

    def _fail_pending(self, name: str, value: str) -> None:
        for pending in self._pending.values():
            if not pending.done.is_set():
                pending.queue.put_nowait(messages.error_line(name, value, ""))
                pending.finish()

    async def _kill(self) -> None:
        await self._disconnect()
        if self._km is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._km.shutdown_kernel(now=True), 30)

    async def shutdown(self) -> None:
        """Stop the kernel for good (DELETE /contexts/{id}, server exit)."""
        self._fail_pending("ContextRemoved", "Context was removed")
        await self._kill()

    async def restart(self) -> None:
        """A fresh kernel under the same id and cwd; a running execution gets an error."""
        self._fail_pending("ContextRestarting", "Context was restarted")
        await self._disconnect()
        assert self._km is not None
        await asyncio.wait_for(
            self._km.restart_kernel(now=True, newports=False), self._settings.start_timeout
        )
        await self._connect()
        self._sandbox_envs = None
        self._pending.clear()

    async def interrupt(self) -> None:
        if self._km is not None:
            try:
                await asyncio.wait_for(self._km.interrupt_kernel(), 10)
            except Exception:
                log.exception("interrupting kernel %s failed", self.id)

    async def alive(self) -> bool:
        return self._km is not None and bool(await self._km.is_alive())

    # messages -----------------------------------------------------------------------------

    async def _read(self, kc: AsyncKernelClient, iopub: bool) -> None:
        """Route every message of one channel to the execution it answers."""
        while True:
            try:
                msg: dict[str, Any] = await (kc.get_iopub_msg() if iopub else kc.get_shell_msg())
            except Exception:
                # A message that fails to parse or verify must not end the routing of the rest.
                log.exception(
                    "bad message on %s of kernel %s", "iopub" if iopub else "shell", self.id
                )
                if not kc.channels_running:
                    return
                continue
            parent = msg.get("parent_header", {}).get("msg_id")
            pending = self._pending.get(parent) if parent else None
            if pending is None or pending.done.is_set():
                continue
            if iopub:
                self._on_iopub(pending, msg)
            else:
                self._on_reply(pending, msg)

    def _on_iopub(self, pending: _Pending, msg: dict[str, Any]) -> None:
        kind = msg["header"].get("msg_type")
        if kind == "status":
            if msg["content"].get("execution_state") == "idle":
                pending.idle = True
                if pending.replied:
                    pending.finish()
            return
        line = messages.iopub_line(msg)
        if line is None:
            return
        if line["type"] == "error":
            if pending.errored:
                return
            pending.errored = True
        pending.queue.put_nowait(line)

    def _on_reply(self, pending: _Pending, msg: dict[str, Any]) -> None:
        if msg["header"].get("msg_type") != "execute_reply":
            return
        content = msg.get("content", {})
        status = content.get("status")
        pending.replied = True
        if status == "error" and not pending.errored:
            pending.errored = True
            pending.queue.put_nowait(
                messages.error_line(
                    str(content.get("ename", "")),
                    str(content.get("evalue", "")),
                    content.get("traceback", []),
                )
            )
        if status == "aborted" or status == "abort":
            pending.queue.put_nowait(
                messages.error_line("ExecutionAborted", "Execution was aborted", "")
            )
            pending.finish()
        elif pending.idle:
            pending.finish()

    def _send(
        self, code: str, silent: bool, store_history: bool | None = None
    ) -> tuple[str, _Pending]:
        if self._kc is None:
            raise KernelGone("kernel is not connected")
        msg_id: str = self._kc.execute(
            code,
            silent=silent,
            store_history=not silent if store_history is None else store_history,
            allow_stdin=False,
            stop_on_error=not silent,
        )
        pending = _Pending()
        self._pending[msg_id] = pending
        return msg_id, pending

    async def _run_silent(self, code: str, *, shown: bool = False) -> None:
        """Run a helper snippet (env vars, the warm-up's cell) and wait for it, with a
        deadline; outside the history either way. `shown`: not silent, so its result takes
        IPython's display path (the output is dropped here)."""
        if not code:
            return
        msg_id, pending = self._send(code, silent=not shown, store_history=False)
        try:
            await asyncio.wait_for(pending.done.wait(), self._settings.snippet_timeout)
        except TimeoutError:
            log.error("helper snippet in %s did not finish in time", self.id)
        finally:
            self._pending.pop(msg_id, None)
        while not pending.queue.empty():
            line = pending.queue.get_nowait()
            if line is not None and line["type"] == "error":
                log.error("helper snippet in %s failed: %s", self.id, line)

    async def warm_up(self) -> None:
        """What a python kernel's first execution does once, done at the server's start:
        in a template it is then in the snapshot and no sandbox repeats it (a first
        `run_code` took ~2 s of TCG, later ones ~0.1 s): the envd client's first request (its
        answer dropped: the template's envd is not the sandbox's), the env-var snippet, and a
        cell with a result (IPython's display path). The cell stays out of the history: a
        sandbox's first execution is still number 1, and `_` is reset to a fresh kernel's."""
        if self.language != "python" or self._kc is None:
            return
        with contextlib.suppress(Exception):
            await envs.fetch_sandbox_envs(
                self._settings.envd_url, None, self._settings.envd_timeout
            )
        await self._run_silent(envs.set_snippet(self.language, {WARM_UP_VAR: "1"}))
        await self._run_silent(envs.set_snippet(self.language, {WARM_UP_VAR: None}))
        await self._run_silent("1 + 1", shown=True)
        await self._run_silent("_ = __ = ___ = ''")

    # execution ----------------------------------------------------------------------------

    async def execute(
        self, code: str, env_vars: dict[str, str], token: str | None
    ) -> AsyncIterator[Line]:
        """Run `code`, yielding output lines; one execution at a time, the next one waits.

        If the consumer goes away (client disconnect), the kernel is interrupted; restoring
        the request's env vars then waits until the interrupted cell has really finished.
        """
        async with self._lock:
            if self._tail is not None:
                with contextlib.suppress(Exception):
                    await self._tail
                self._tail = None
            msg_id: str | None = None
            pending: _Pending | None = None
            finished = False
            try:
                try:
                    await self._apply_sandbox_envs(token)
                    await self._run_silent(envs.set_snippet(self.language, dict(env_vars)))
                    msg_id, pending = self._send(code, silent=False)
                except KernelGone as exc:
                    finished = True
                    yield messages.error_line("ContextUnavailable", str(exc), "")
                    yield messages.END
                    return
                while True:
                    try:
                        line = await asyncio.wait_for(pending.queue.get(), self._settings.keepalive)
                    except TimeoutError:
                        if not await self.alive():
                            finished = True
                            yield messages.error_line(
                                "ContextRestarting", "Context was restarted", ""
                            )
                            await self._revive()
                            break
                        yield messages.KEEPALIVE
                        continue
                    if line is None:
                        finished = True
                        yield messages.END
                        break
                    yield line
            finally:
                if not finished and msg_id is not None:
                    log.warning("execution %s abandoned, interrupting kernel %s", msg_id, self.id)
                    await asyncio.shield(self.interrupt())
                # Also when cancelled before the code was sent: the env snippet may have run.
                self._tail = asyncio.create_task(self._after(msg_id, pending, list(env_vars)))

    async def _after(self, msg_id: str | None, pending: _Pending | None, keys: list[str]) -> None:
        """Wait for the cell to finish (it may have been interrupted), then restore env vars."""
        if msg_id is not None and pending is not None:
            try:
                await asyncio.wait_for(pending.done.wait(), self._settings.snippet_timeout)
            except TimeoutError:
                log.error("execution %s did not finish after interrupt", msg_id)
            finally:
                self._pending.pop(msg_id, None)
        if keys and self._kc is not None:
            values = envs.restore_values(keys, self._sandbox_envs or {}, self._start_env)
            await self._run_silent(envs.set_snippet(self.language, values))

    async def _apply_sandbox_envs(self, token: str | None) -> None:
        if self._sandbox_envs is not None:
            return
        try:
            got = await envs.fetch_sandbox_envs(
                self._settings.envd_url, token, self._settings.envd_timeout
            )
        except Exception as exc:
            log.warning("sandbox env vars not fetched from envd (retry next time): %r", exc)
            return
        self._sandbox_envs = got
        await self._run_silent(envs.set_snippet(self.language, dict(got)))

    async def _revive(self) -> None:
        """The kernel process died mid-execution: start a new one so the next one runs."""
        try:
            await self.restart()
        except Exception:
            log.exception("restarting dead kernel %s failed", self.id)
