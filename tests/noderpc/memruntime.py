"""A small in-memory `Runtime` for the RPC tests: it records every call and answers from a
dict, so what the tests check is the transport (values, errors, deadlines, streams)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from agentenv.contract.runtime import (
    Found,
    GuestCommand,
    HostMemory,
    ImportEvent,
    Placement,
    SandboxSpec,
    SnapshotInfo,
    TemplateInfo,
    Unsupported,
)
from agentenv.network.egress import Egress

# Templates with a behaviour: "slow" creates take a minute, "doomed" ones end on their own
# a moment after they start (their VM "exits"), "hang" ones never finish.
SLOW_S = 60.0
DOOM_AFTER_S = 0.05


@dataclass
class Held:
    spec: SandboxSpec
    state: str = "running"
    memory: bool = True
    egress: Egress = field(default_factory=Egress)


class MemoryRuntime:
    def __init__(self) -> None:
        self.held: dict[str, Held] = {}
        self.lost: dict[str, str] = {}
        self.calls: list[tuple[str, tuple[object, ...]]] = []
        self.activity: list[str] = []
        self.handlers: list[Callable[[str, str], None]] = []
        self.images: set[str] = set()
        self.snaps: list[SnapshotInfo] = []
        # Creates that were cancelled while they ran (the caller gone, or past its deadline).
        self.cancelled: list[str] = []
        # Raised by the next call (any method but note_activity), once.
        self.fail: BaseException | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    def _enter(self, name: str, *args: object) -> None:
        self.calls.append((name, args))
        if self.fail is not None:
            exc, self.fail = self.fail, None
            raise exc

    def placement(self, sandbox_id: str, booted: bool = False) -> Placement:
        n = sum(map(ord, sandbox_id)) % 250 + 1
        return Placement(sandbox_id, f"198.18.0.{n}", f"http://198.18.0.{n}:49983", booted)

    def lose(self, sandbox_id: str, why: str) -> None:
        self.held.pop(sandbox_id, None)
        self.lost[sandbox_id] = why
        for handler in list(self.handlers):
            handler(sandbox_id, why)

    async def start(self) -> None:
        self.calls.append(("start", ()))

    async def close(self) -> None:
        self.calls.append(("close", ()))
        for task in self._tasks:
            task.cancel()

    async def create(self, spec: SandboxSpec) -> Placement:
        self._enter("create", spec)
        if spec.template == "slow":
            await asyncio.sleep(SLOW_S)
        if spec.template == "hang":
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                self.cancelled.append(spec.sandbox_id)
                raise
        self.held[spec.sandbox_id] = Held(spec, egress=spec.egress)
        if spec.template == "doomed":

            async def doom() -> None:
                await asyncio.sleep(DOOM_AFTER_S)
                self.lose(spec.sandbox_id, "VM exited with status 137")

            task = asyncio.create_task(doom())
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        return self.placement(spec.sandbox_id)

    async def update_egress(self, sandbox_id: str, egress: Egress) -> None:
        self._enter("update_egress", sandbox_id, egress)
        self.held[sandbox_id].egress = egress

    async def delete(self, sandbox_id: str) -> None:
        self._enter("delete", sandbox_id)
        self.held.pop(sandbox_id, None)

    async def forget(self, sandbox_id: str) -> None:
        self._enter("forget", sandbox_id)
        self.held.pop(sandbox_id, None)

    async def pause(
        self,
        sandbox_id: str,
        *,
        memory: bool = True,
        envd_token: str | None = None,
        strict: bool = True,
    ) -> None:
        self._enter("pause", sandbox_id, memory, envd_token, strict)
        held = self.held[sandbox_id]
        held.state, held.memory = "paused", memory

    async def resume(self, spec: SandboxSpec, *, memory: bool = True) -> Placement:
        self._enter("resume", spec, memory)
        held = self.held[spec.sandbox_id]
        booted = not (memory and held.memory)
        held.state, held.spec, held.memory = "running", spec, True
        return self.placement(spec.sandbox_id, booted=booted)

    async def reset(self, spec: SandboxSpec) -> Placement:
        self._enter("reset", spec)
        held = self.held[spec.sandbox_id]
        if held.state != "running":
            raise Unsupported(f"sandbox {spec.sandbox_id} is {held.state}")
        held.spec = spec
        return self.placement(spec.sandbox_id)

    async def init_guest(self, spec: SandboxSpec) -> None:
        self._enter("init_guest", spec)
        self.held[spec.sandbox_id].spec = spec

    async def guest_metrics(self, sandbox_id: str, envd_token: str | None) -> dict[str, Any] | None:
        self._enter("guest_metrics", sandbox_id, envd_token)
        if sandbox_id == "binary":
            return {"raw": b"\x00"}  # not JSON: the server must say so, not crash
        if sandbox_id not in self.held:
            return None
        return {"ts": 1_700_000_000, "cpu_pct": 12.5, "mem_used": 104857600, "disks": [{"a": None}]}

    async def guest_health(self, sandbox_id: str) -> str | None:
        self._enter("guest_health", sandbox_id)
        return None if sandbox_id in self.held else "envd: connection refused"

    async def is_alive(self, sandbox_id: str) -> bool:
        self._enter("is_alive", sandbox_id)
        return sandbox_id in self.held

    async def find(self, sandbox_id: str) -> Found | None:
        self._enter("find", sandbox_id)
        held = self.held.get(sandbox_id)
        if held is None:
            return None
        if held.state == "paused":
            return Found("paused", None, memory=held.memory)
        return Found("running", self.placement(sandbox_id))

    async def sandbox_ids(self) -> list[str]:
        self._enter("sandbox_ids")
        return list(self.held)

    async def lost_reason(self, sandbox_id: str) -> str | None:
        self._enter("lost_reason", sandbox_id)
        return self.lost.get(sandbox_id)

    def watch_lost(self, handler: Callable[[str, str], None]) -> None:
        self.handlers.append(handler)

    async def snapshot(
        self, sandbox_id: str, name: str | None, envd_token: str | None, *, memory: bool = True
    ) -> SnapshotInfo:
        self._enter("snapshot", sandbox_id, name, envd_token, memory)
        held = self.held[sandbox_id]
        info = SnapshotInfo(
            snapshot_id=f"snap-{len(self.snaps) + 1}",
            names=[] if name is None else [name],
            source=sandbox_id,
            created_at=1_700_000_000.25 + len(self.snaps),
            cpu=held.spec.cpu,
            memory_mb=held.spec.memory_mb,
        )
        self.snaps.append(info)
        return info

    async def fork(
        self, sandbox_id: str, children: list[SandboxSpec], envd_token: str | None
    ) -> list[Placement]:
        self._enter("fork", sandbox_id, children, envd_token)
        for child in children:
            self.held[child.sandbox_id] = Held(child)
        return [self.placement(c.sandbox_id) for c in children]

    async def snapshots(self) -> list[SnapshotInfo]:
        self._enter("snapshots")
        return list(self.snaps)

    async def delete_snapshot(self, snapshot_id: str) -> bool:
        self._enter("delete_snapshot", snapshot_id)
        before = len(self.snaps)
        self.snaps = [s for s in self.snaps if s.snapshot_id != snapshot_id]
        return len(self.snaps) < before

    async def import_image(
        self,
        ref: str,
        name: str,
        credentials: tuple[str, str] | None,
        on_event: Callable[[ImportEvent], None],
    ) -> TemplateInfo:
        """Reports a line from the loop and a layer from a worker thread (as a pull does)."""
        self._enter("import_image", ref, name, credentials)
        on_event(ImportEvent(message=f"pulling {ref}"))
        layer = {"phase": "download", "index": 0, "count": 1, "digest": "sha256:" + "d" * 64,
                 "done": 10, "total": 10, "cached": False}  # fmt: skip
        await asyncio.to_thread(on_event, ImportEvent(layer=layer))
        return TemplateInfo(name, 64, 1.0, 1.0, 1, 512, layers=("e" * 64,),
                            env=(("A", "b"),), user="app", workdir="/app")  # fmt: skip

    async def remove_image(self, name: str) -> bool:
        self._enter("remove_image", name)
        if name in self.images:
            self.images.discard(name)
            return True
        return False

    async def gateway(self, node_id: str) -> str | None:
        return None

    async def guest_run(
        self,
        sandbox_id: str,
        envd_token: str | None,
        command: GuestCommand,
        on_line: Callable[[str, str], None],
    ) -> int:
        """Echoes the command's fields as output lines, one from a worker thread; the exit
        code is the command's length."""
        self._enter("guest_run", sandbox_id, envd_token, command)
        on_line(f"ran {command.cmd}", "stdout")
        await asyncio.to_thread(on_line, f"as {command.user} in {command.cwd}", "stderr")
        return len(command.cmd)

    async def guest_write(
        self, sandbox_id: str, envd_token: str | None, path: str, data: bytes, *, append: bool
    ) -> None:
        self._enter("guest_write", sandbox_id, envd_token, path, data, append)

    async def guest_defaults(
        self, sandbox_id: str, envd_token: str | None, user: str, workdir: str
    ) -> None:
        self._enter("guest_defaults", sandbox_id, envd_token, user, workdir)

    def note_activity(self, sandbox_id: str) -> None:
        self.activity.append(sandbox_id)

    async def host_memory(self, sandbox_id: str) -> HostMemory | None:
        self._enter("host_memory", sandbox_id)
        if sandbox_id not in self.held:
            return None
        return HostMemory(
            rss=300 << 20, pss=200 << 20, pss_anon=150 << 20, pss_file=49 << 20, pss_shmem=1 << 20
        )
