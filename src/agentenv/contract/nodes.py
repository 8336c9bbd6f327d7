"""What the control plane knows of the nodes that run its sandboxes (`GET /nodes`, `aenv node`).

One node in-process answers for itself; a cluster answers from etcd's member list. Either way
the API sees the same `NodeStatus` rows and the same cordon/drain operations.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

NodeState = Literal["ready", "cordoned"]


@dataclass(frozen=True)
class NodeStatus:
    node_id: str
    state: NodeState
    # Where the control plane calls it ("" for the in-process node).
    rpc_url: str
    version: str
    cpus: int
    memory_mb: int
    slots: int
    free_memory_mb: int
    free_slots: int
    # Sandboxes it runs now, and paused ones it keeps.
    running: int
    paused: int
    # When it last said how loaded it is (unix seconds).
    updated_at: float
    cordon_reason: str = ""
    # Where replicas reach its guests (its data gateway, [tls://]HOST:PORT); "" = directly.
    gateway: str = ""


class UnknownNode(Exception):
    """No node by that id is a member now."""


class NodeDirectory(Protocol):
    async def nodes(self) -> list[NodeStatus]:
        """Every live node, sorted by id."""
        ...

    async def node(self, node_id: str) -> NodeStatus:
        """Raises `UnknownNode`."""
        ...

    async def cordon(self, node_id: str, *, cordoned: bool, reason: str = "") -> NodeStatus:
        """A cordoned node takes no new sandboxes (creates go elsewhere); what runs there
        keeps running. Raises `UnknownNode`."""
        ...

    async def sandboxes_on(self, node_id: str) -> list[str]:
        """Ids of the sandboxes (running or paused) the node holds. Raises `UnknownNode`."""
        ...
