"""Which node each sandbox is on: `<prefix>bindings/<sandbox_id>` -> {"node_id": ...}.

Bindings are persistent (no lease). When a node dies its sandboxes keep their binding, so the
control plane still sees them: a running one is reported lost, a paused one can be moved to a
node that resumes it. Every change is one transaction guarded by what the key holds, which is
what makes two replicas racing on one sandbox safe without any lock:

- create only if absent (create revision 0): of two concurrent creates exactly one wins;
- move only from the node it is on (the value compares equal to that node's binding);
- delete likewise only what is there.

The value holds nothing but the node id, in one canonical encoding, so the guard can compare
it byte for byte. `<prefix>node-bindings/<node_id>/<sandbox_id>` is an index written in the same
transactions, so one node's sandboxes are a prefix read, not a scan of all bindings.
"""

from __future__ import annotations

import json

from agentenv.cluster.etcd import (
    Etcd,
    KeyValue,
    created_at,
    delete_op,
    get_op,
    put_op,
    value_is,
)

BINDINGS = "bindings"
NODE_BINDINGS = "node-bindings"
# A delete that keeps losing to concurrent moves gives up after this many rounds.
_DELETE_ROUNDS = 8


def _encode(node_id: str) -> bytes:
    return json.dumps({"node_id": node_id}, separators=(",", ":")).encode()


def _node_of(kv: KeyValue) -> str:
    node_id = json.loads(kv.value)["node_id"]
    if not isinstance(node_id, str):
        raise ValueError(f"binding {kv.key!r}: node_id is {node_id!r}")
    return node_id


class Bindings:
    def __init__(self, etcd: Etcd) -> None:
        self._etcd = etcd

    def _key(self, sandbox_id: str) -> bytes:
        return self._etcd.key(BINDINGS, sandbox_id)

    def _index(self, node_id: str, sandbox_id: str) -> bytes:
        return self._etcd.key(NODE_BINDINGS, node_id, sandbox_id)

    async def create(self, sandbox_id: str, node_id: str) -> bool:
        """Binds the sandbox to the node if it has no binding. True when it is now bound to
        `node_id` (this call won, or a retry of it already had); False: bound elsewhere."""
        key = self._key(sandbox_id)
        result = await self._etcd.txn(
            [created_at(key, 0)],
            [put_op(key, _encode(node_id)), put_op(self._index(node_id, sandbox_id), b"{}")],
            [get_op(key)],
        )
        if result.succeeded:
            return True
        (current,) = result.ranges
        return bool(current) and _node_of(current[0]) == node_id

    async def get(self, sandbox_id: str) -> str | None:
        """The node the sandbox is bound to, None if it has no binding."""
        kv = await self._etcd.get(self._key(sandbox_id))
        return None if kv is None else _node_of(kv)

    async def move(self, sandbox_id: str, from_node: str, to_node: str) -> bool:
        """Rebinds the sandbox from `from_node` to `to_node`. False (nothing changed) when it
        is not on `from_node`: another replica moved or deleted it first."""
        key = self._key(sandbox_id)
        if from_node == to_node:
            return await self.get(sandbox_id) == to_node
        result = await self._etcd.txn(
            [value_is(key, _encode(from_node))],
            [
                put_op(key, _encode(to_node)),
                delete_op(self._index(from_node, sandbox_id)),
                put_op(self._index(to_node, sandbox_id), b"{}"),
            ],
            [get_op(key)],
        )
        if result.succeeded:
            return True
        # A retried move whose first answer was lost finds its own result in place.
        (current,) = result.ranges
        return bool(current) and _node_of(current[0]) == to_node

    async def delete(self, sandbox_id: str, node_id: str | None = None) -> bool:
        """Removes the binding (only if it is on `node_id`, when given). False: no binding
        there to remove."""
        key = self._key(sandbox_id)
        for _ in range(_DELETE_ROUNDS):
            on = node_id
            if on is None:
                on = await self.get(sandbox_id)
                if on is None:
                    return False
            result = await self._etcd.txn(
                [value_is(key, _encode(on))],
                [delete_op(key), delete_op(self._index(on, sandbox_id))],
            )
            if result.succeeded:
                return True
            if node_id is not None:
                return False
            # Moved between our read and the delete: read again.
        return False

    async def all(self) -> dict[str, str]:
        """sandbox id -> node id, for every bound sandbox."""
        kvs, _ = await self._etcd.get_prefix(self._etcd.dir(BINDINGS))
        prefix = len(self._etcd.dir(BINDINGS))
        return {kv.key[prefix:].decode(): _node_of(kv) for kv in kvs}

    async def of_node_revisions(self, node_id: str) -> dict[str, int]:
        """The sandboxes bound to one node, each with the revision it was bound there at (its
        index key's): a binding that moved away and back meanwhile has a newer one."""
        kvs, _ = await self._etcd.get_prefix(self._etcd.dir(NODE_BINDINGS, node_id))
        prefix = len(self._etcd.dir(NODE_BINDINGS, node_id))
        return {kv.key[prefix:].decode(): kv.mod_revision for kv in kvs}

    async def of_node(self, node_id: str) -> list[str]:
        """The sandboxes bound to one node, sorted."""
        kvs, _ = await self._etcd.get_prefix(self._etcd.dir(NODE_BINDINGS, node_id))
        prefix = len(self._etcd.dir(NODE_BINDINGS, node_id))
        return sorted(kv.key[prefix:].decode() for kv in kvs)
