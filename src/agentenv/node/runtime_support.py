"""What the in-process node's `Runtime` adapter (`runtime.NodeRuntime`) maps and reports
besides its calls: the node's refusals and a full data dir as the contract's errors, the
host's size, and `LocalNodes`, the single-node server's `NodeDirectory`. Split from
`runtime.py`, which re-exports `LocalNodes`."""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

from agentenv import snapshot as snaps
from agentenv.contract.errors import InsufficientStorage, Unavailable
from agentenv.contract.nodes import NodeDirectory, NodeStatus, UnknownNode
from agentenv.node.errors import NoCapacity, ResetLost
from agentenv.node.host import Node

# The id the in-process node has in `GET /nodes` when no `AGENTENV_NODE_ID` names it.
LOCAL_NODE = "local"


def out_of_space(exc: BaseException) -> bool:
    """ENOSPC anywhere in the chain: an OSError, or a tool's message (qemu-img, QEMU)."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            return True
        if "No space left on device" in str(e):
            return True
        e = e.__cause__ or e.__context__
    return False


@contextlib.contextmanager
def capacity(data_dir: Path) -> Iterator[None]:
    """A node's refusal (`NoCapacity`) as 503 with its retry hint, a full data dir as 507.
    The node releases what the operation made before either reaches here."""
    try:
        yield
    except NoCapacity as exc:
        raise Unavailable(str(exc), exc.retry_after_s) from exc
    except Exception as exc:
        # A resumed or reset guest that was lost stays lost, whatever filled the disk.
        if isinstance(exc, (snaps.ResumedButLost, ResetLost)) or not out_of_space(exc):
            raise
        raise InsufficientStorage(f"no space left in the data dir {data_dir}: {exc}") from exc


def host_capacity() -> tuple[int, int]:
    """(CPUs, MiB of RAM) of this host."""
    mem_kb = 0
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem_kb = int(line.split()[1])
    return os.cpu_count() or 1, mem_kb // 1024


class _Local(Protocol):
    """What `LocalNodes` uses of `runtime.NodeRuntime` (named here, not imported: that
    module imports this one)."""

    node: Node
    cordon_reason: str | None

    def status(self, node_id: str = ..., rpc_url: str = ..., version: str = ...) -> NodeStatus: ...


class LocalNodes:
    """`NodeDirectory` of the single-node server: its one in-process node. A cordon refuses
    new sandboxes there (503), as a cluster's would send them elsewhere."""

    def __init__(self, runtime: _Local, node_id: str = LOCAL_NODE) -> None:
        self.runtime = runtime
        self.node_id = node_id

    async def nodes(self) -> list[NodeStatus]:
        return [self.runtime.status(self.node_id)]

    async def node(self, node_id: str) -> NodeStatus:
        if node_id != self.node_id:
            raise UnknownNode(f"no node {node_id!r} (this server runs one node, {self.node_id!r})")
        return self.runtime.status(self.node_id)

    async def cordon(self, node_id: str, *, cordoned: bool, reason: str = "") -> NodeStatus:
        await self.node(node_id)
        self.runtime.cordon_reason = (reason or "cordoned") if cordoned else None
        return self.runtime.status(self.node_id)

    async def sandboxes_on(self, node_id: str) -> list[str]:
        await self.node(node_id)
        return self.runtime.node.sandbox_ids()


def _is_a_directory(nodes: LocalNodes) -> NodeDirectory:
    return nodes
