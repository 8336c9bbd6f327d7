"""`RemoteRuntime`: the `Runtime` contract as calls to a node agent's `NodeService`.

Every call has a deadline (queries short, changes longer, VM operations long: `NodeRpcConfig`)
and the node's failures come back as the contract's classes. A node that does not answer is
`NodeUnreachable` (an `Unavailable`: the API answers 503 with a Retry-After) naming the node.
`note_activity` never waits: ids are batched and sent by a background task. `watch_lost`
follows the node's lost-sandbox stream in the background, reconnecting when it breaks.

Its parts: `channel` (the client, deadlines, error translation) and `node_streams` (activity
batches, the lost watch); this module holds the contract's calls, start and close.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from pyqwest import Client as HTTPClient
from pyqwest import HTTPTransport, Proxy

from agentenv.config import Settings
from agentenv.contract.egress import Egress
from agentenv.contract.runtime import (
    Found,
    GuestCommand,
    HostMemory,
    ImportEvent,
    Placement,
    Runtime,
    SandboxSpec,
    SnapshotInfo,
    TemplateInfo,
)
from agentenv.noderpc.node_streams import NodeStreams

from . import convert
from .convert import opt_str
from .errors import NodeError
from .gen import node_pb as pb
from .gen.node_connect import NodeServiceClient

log = logging.getLogger(__name__)

# An image import pulls every layer it lacks: minutes for a large image on a slow link.
IMPORT_DEADLINE_S = 1800.0
# How many times, a second apart, `close` cancels a background task that has not ended.
CLOSE_ROUNDS = 10
CLOSE_WAIT_S = 1.0


class RemoteRuntime(NodeStreams):
    """A node's `Runtime`, reached at `url` (`http(s)://host:port`) with the node token; an
    https node's certificate is checked against `config.tls_ca` (else the system store)."""

    @classmethod
    def from_settings(cls, url: str, settings: Settings) -> RemoteRuntime:
        """A client of the node at `url` with the settings' token and deadlines."""
        if not settings.node_token:
            raise ValueError("AGENTENV_NODE_TOKEN is not set: the node RPC needs it")
        return cls(url, settings.node_token, config=settings.node_rpc)

    async def start(self) -> None:
        if self._rpc is not None:
            return
        tls = await self._tls_options()
        if self._rpc is not None:
            return
        self._transport = HTTPTransport(
            **tls,
            connect_timeout=self.config.connect_s,
            # Shorter than the server's keep-alive (75 s), so an idle connection is closed
            # by us, never reused just as the server closes it.
            pool_idle_timeout=30.0,
            pool_max_idle_per_host=64,
            tcp_keepalive_interval=15.0,
            # A node is reached directly: HTTP(S)_PROXY from the environment must not apply.
            # An explicit proxy turns the environment's off; this one matches no host (every
            # IPv4, every IPv6 and, for names, "*"), so nothing goes through it.
            proxy=Proxy("http://127.0.0.1:9", no_proxy="0.0.0.0/0,::/0,*"),
            follow_redirects=False,
            enable_otel=False,
        )
        self._rpc = NodeServiceClient(
            self.url, http_client=HTTPClient(self._transport), send_compression=None
        )
        self._activity_task = asyncio.create_task(self._send_activity())
        if self._handlers:
            self._start_watch()

    async def close(self) -> None:
        pending = {t for t in (self._watch_task, self._activity_task) if t is not None}
        self._watch_task = self._activity_task = None
        # A background task can swallow its cancel (one landing as a call's own deadline
        # fires turns into that call's TimeoutError, which the task survives), so it is sent
        # again until the task ends: a close never waits on it forever. Seen once in the suite:
        # a close that hung 15 minutes in the activity sender's idle wait.
        for _ in range(CLOSE_ROUNDS):
            if not pending:
                break
            for task in pending:
                task.cancel()
            _, pending = await asyncio.wait(pending, timeout=CLOSE_WAIT_S)
        if pending:
            log.error("node %s: %d background task(s) did not stop", self.url, len(pending))
        rpc, transport = self._rpc, self._transport
        self._rpc = self._transport = None
        if rpc is not None:
            await rpc.close()
        if transport is not None:
            await transport.aclose()

    async def reset(self, spec: SandboxSpec) -> Placement:
        # An agent without the RPC answers UNIMPLEMENTED (`Unsupported`): the control plane
        # then deletes and creates.
        req = pb.ResetRequest(spec=convert.spec_to_pb(spec))
        res = await self._call(
            "Reset",
            self._long_s,
            lambda ms: self._client().reset(req, headers=self._headers, timeout_ms=ms),
        )
        return convert.placement_from_pb(res.placement)

    async def create_many(self, specs: Sequence[SandboxSpec]) -> list[Placement | BaseException]:
        # One create each (the node's batch start is for its own in-process runtime).
        return list(await asyncio.gather(*map(self.create, specs), return_exceptions=True))

    async def create(self, spec: SandboxSpec) -> Placement:
        req = pb.CreateRequest(spec=convert.spec_to_pb(spec))
        res = await self._call(
            "Create",
            # A create may wait in the node's capacity queue first, as long as it was allowed.
            self._long_s + (spec.capacity_wait_s or 0.0),
            lambda ms: self._client().create(req, headers=self._headers, timeout_ms=ms),
        )
        return convert.placement_from_pb(res.placement)

    async def update_egress(self, sandbox_id: str, egress: Egress) -> None:
        req = pb.UpdateEgressRequest(sandbox_id=sandbox_id, egress=convert.egress_to_pb(egress))
        await self._call(
            "UpdateEgress",
            self._change_s,
            lambda ms: self._client().update_egress(req, headers=self._headers, timeout_ms=ms),
        )

    async def delete(self, sandbox_id: str) -> None:
        req = pb.SandboxRef(sandbox_id=sandbox_id)
        await self._call(
            "Delete",
            self._change_s,
            lambda ms: self._client().delete(req, headers=self._headers, timeout_ms=ms),
        )

    async def forget(self, sandbox_id: str) -> None:
        req = pb.SandboxRef(sandbox_id=sandbox_id)
        await self._call(
            "Forget",
            self._change_s,
            lambda ms: self._client().forget(req, headers=self._headers, timeout_ms=ms),
        )

    async def pause(
        self,
        sandbox_id: str,
        *,
        memory: bool = True,
        envd_token: str | None = None,
        strict: bool = True,
    ) -> None:
        req = pb.PauseRequest(
            sandbox_id=sandbox_id, memory=memory, envd_token=envd_token, strict=strict
        )
        await self._call(
            "Pause",
            self._long_s,
            lambda ms: self._client().pause(req, headers=self._headers, timeout_ms=ms),
        )

    async def resume(self, spec: SandboxSpec, *, memory: bool = True) -> Placement:
        req = pb.ResumeRequest(spec=convert.spec_to_pb(spec), memory=memory)
        res = await self._call(
            "Resume",
            self._long_s,
            lambda ms: self._client().resume(req, headers=self._headers, timeout_ms=ms),
        )
        return convert.placement_from_pb(res.placement)

    async def init_guest(self, spec: SandboxSpec) -> None:
        req = pb.InitGuestRequest(spec=convert.spec_to_pb(spec))
        await self._call(
            "InitGuest",
            self._change_s,
            lambda ms: self._client().init_guest(req, headers=self._headers, timeout_ms=ms),
        )

    async def guest_metrics(self, sandbox_id: str, envd_token: str | None) -> dict[str, Any] | None:
        req = pb.GuestMetricsRequest(sandbox_id=sandbox_id, envd_token=envd_token)
        res = await self._call(
            "GuestMetrics",
            self._query_s,
            lambda ms: self._client().guest_metrics(req, headers=self._headers, timeout_ms=ms),
        )
        text = opt_str(res, "json")
        if text is None:
            return None
        sample = json.loads(text)
        if not isinstance(sample, dict):
            raise NodeError(f"node {self.url}: GuestMetrics sent {type(sample).__name__}")
        return sample

    async def guest_health(self, sandbox_id: str) -> str | None:
        req = pb.SandboxRef(sandbox_id=sandbox_id)
        res = await self._call(
            "GuestHealth",
            self._query_s,
            lambda ms: self._client().guest_health(req, headers=self._headers, timeout_ms=ms),
        )
        return opt_str(res, "text")

    async def is_alive(self, sandbox_id: str) -> bool:
        req = pb.SandboxRef(sandbox_id=sandbox_id)
        res = await self._call(
            "IsAlive",
            self._query_s,
            lambda ms: self._client().is_alive(req, headers=self._headers, timeout_ms=ms),
        )
        return res.alive

    async def find(self, sandbox_id: str) -> Found | None:
        req = pb.SandboxRef(sandbox_id=sandbox_id)
        res = await self._call(
            "Find",
            self._query_s,
            lambda ms: self._client().find(req, headers=self._headers, timeout_ms=ms),
        )
        return None if res.found is None else convert.found_from_pb(res.found)

    async def sandbox_ids(self) -> list[str]:
        res = await self._call(
            "SandboxIds",
            self._query_s,
            lambda ms: self._client().sandbox_ids(pb.Empty(), headers=self._headers, timeout_ms=ms),
        )
        return list(res.sandbox_ids)

    async def lost_reason(self, sandbox_id: str) -> str | None:
        req = pb.SandboxRef(sandbox_id=sandbox_id)
        res = await self._call(
            "LostReason",
            self._query_s,
            lambda ms: self._client().lost_reason(req, headers=self._headers, timeout_ms=ms),
        )
        return opt_str(res, "text")

    async def snapshot(
        self, sandbox_id: str, name: str | None, envd_token: str | None, *, memory: bool = True
    ) -> SnapshotInfo:
        req = pb.SnapshotRequest(
            sandbox_id=sandbox_id, name=name, envd_token=envd_token, memory=memory
        )
        res = await self._call(
            "Snapshot",
            self._long_s,
            lambda ms: self._client().snapshot(req, headers=self._headers, timeout_ms=ms),
        )
        return convert.snapshot_from_pb(res)

    async def fork(
        self, sandbox_id: str, children: list[SandboxSpec], envd_token: str | None
    ) -> list[Placement]:
        req = pb.ForkRequest(
            sandbox_id=sandbox_id,
            children=[convert.spec_to_pb(c) for c in children],
            envd_token=envd_token,
        )
        res = await self._call(
            "Fork",
            self._long_s,
            lambda ms: self._client().fork(req, headers=self._headers, timeout_ms=ms),
        )
        return [convert.placement_from_pb(p) for p in res.placements]

    async def snapshots(self) -> list[SnapshotInfo]:
        res = await self._call(
            "Snapshots",
            self._query_s,
            lambda ms: self._client().snapshots(pb.Empty(), headers=self._headers, timeout_ms=ms),
        )
        return [convert.snapshot_from_pb(s) for s in res.snapshots]

    async def import_image(
        self,
        ref: str,
        name: str,
        credentials: tuple[str, str] | None,
        on_event: Callable[[ImportEvent], None],
    ) -> TemplateInfo:
        if credentials is None:
            req = pb.ImportImageRequest(ref=ref, name=name)
        else:
            user, password = credentials
            req = pb.ImportImageRequest(ref=ref, name=name, username=user, password=password)

        async def run(ms: int) -> TemplateInfo:
            done: TemplateInfo | None = None
            stream = self._client().import_image(req, headers=self._headers, timeout_ms=ms)
            async for event in stream:
                if event.has_field("template_json"):
                    done = TemplateInfo.from_json(event.template_json)
                elif event.has_field("layer_json"):
                    on_event(ImportEvent(layer=json.loads(event.layer_json)))
                else:
                    on_event(ImportEvent(message=event.message))
            if done is None:
                raise NodeError(f"node {self.url}: the import of {ref} ended without a template")
            return done

        return await self._call("ImportImage", IMPORT_DEADLINE_S, run)

    async def delete_snapshot(self, snapshot_id: str) -> bool:
        req = pb.SnapshotRef(snapshot_id=snapshot_id)
        res = await self._call(
            "DeleteSnapshot",
            self._change_s,
            lambda ms: self._client().delete_snapshot(req, headers=self._headers, timeout_ms=ms),
        )
        return bool(res.deleted)

    async def remove_image(self, name: str) -> bool:
        req = pb.ImageRef(name=name)
        res = await self._call(
            "RemoveImage",
            self._change_s,
            lambda ms: self._client().remove_image(req, headers=self._headers, timeout_ms=ms),
        )
        return bool(res.deleted)

    async def host_memory(self, sandbox_id: str) -> HostMemory | None:
        req = pb.SandboxRef(sandbox_id=sandbox_id)
        res = await self._call(
            "HostMemory",
            self._query_s,
            lambda ms: self._client().host_memory(req, headers=self._headers, timeout_ms=ms),
        )
        return None if res.memory is None else convert.memory_from_pb(res.memory)

    async def guest_run(
        self,
        sandbox_id: str,
        envd_token: str | None,
        command: GuestCommand,
        on_line: Callable[[str, str], None],
    ) -> int:
        req = pb.GuestRunRequest(
            sandbox_id=sandbox_id,
            envd_token=envd_token,
            cmd=command.cmd,
            user=command.user,
            envs=dict(command.envs),
            cwd=command.cwd,
            timeout_s=command.timeout_s,
        )

        async def run(ms: int) -> int:
            stream = self._client().guest_run(req, headers=self._headers, timeout_ms=ms)
            async for event in stream:
                if event.has_field("exit_code"):
                    return int(event.exit_code)
                on_line(event.line, event.stream)
            raise NodeError(f"node {self.url}: a command in {sandbox_id} ended without its code")

        # The command's own deadline, and a little for the node to report it.
        return await self._call("GuestRun", command.timeout_s + self._change_s, run)

    async def guest_write(
        self, sandbox_id: str, envd_token: str | None, path: str, data: bytes, *, append: bool
    ) -> None:
        req = pb.GuestWriteRequest(
            sandbox_id=sandbox_id, envd_token=envd_token, path=path, data=data, append=append
        )
        await self._call(
            "GuestWrite",
            self._long_s,
            lambda ms: self._client().guest_write(req, headers=self._headers, timeout_ms=ms),
        )

    async def guest_defaults(
        self, sandbox_id: str, envd_token: str | None, user: str, workdir: str
    ) -> None:
        req = pb.GuestDefaultsRequest(
            sandbox_id=sandbox_id, envd_token=envd_token, user=user, workdir=workdir
        )
        await self._call(
            "GuestDefaults",
            self._change_s,
            lambda ms: self._client().guest_defaults(req, headers=self._headers, timeout_ms=ms),
        )

    async def gateway(self, node_id: str) -> str | None:
        """Guests of this node are reached at their slot addresses."""
        return None


if TYPE_CHECKING:

    def _is_a_runtime(remote: RemoteRuntime) -> Runtime:
        # mypy proves RemoteRuntime implements the whole protocol here.
        return remote
