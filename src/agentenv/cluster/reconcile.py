"""Membership and reconciliation (`ClusterReconcile`): a node joining or leaving, and bindings
to a live node that no longer holds the sandbox (found when it joins and every
`node_reconcile_s`), reported lost. Split from `runtime.py`."""

from __future__ import annotations

import asyncio
import contextlib
import time

from agentenv.cluster.membership import NodeInfo
from agentenv.cluster.routing import RECONCILE_ASKS, ClusterRouting, log
from agentenv.noderpc.client import RemoteRuntime


class ClusterReconcile(ClusterRouting):
    """Node membership and reconciliation of the cluster runtime."""

    async def _watch_nodes(self) -> None:
        while True:
            watch = self.membership.watch(include_existing=True)
            try:
                async for event in watch:
                    if event.kind == "joined":
                        self._live.add(event.node_id)
                        if event.info is not None:
                            self._spawn(self._joined(event.info))
                    else:
                        self._live.discard(event.node_id)
                        self._spawn(self._left(event.node_id))
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("cluster: node watch failed (%s); watching again", exc)
            finally:
                with contextlib.suppress(Exception):
                    await watch.stop()
            await asyncio.sleep(1.0)

    async def _joined(self, info: NodeInfo) -> None:
        """A node (back) in the cluster: its client, and what it holds that nobody is bound
        to any more (killed while it was away) goes."""
        try:
            client = await self._client_for(info)
            held = await client.sandbox_ids()
            for rid in held:
                bound = await self.bindings.get(rid)
                if bound is None:
                    log.warning(
                        "node %s holds %s, bound to no node: deleting it", info.node_id, rid
                    )
                    with contextlib.suppress(Exception):
                        await client.delete(rid)
                elif bound != info.node_id:
                    # Resumed elsewhere while this node was away: only its old copy goes.
                    log.warning("node %s holds an old copy of %s (now on %s): dropping it",
                                info.node_id, rid, bound)  # fmt: skip
                    with contextlib.suppress(Exception):
                        await client.forget(rid)
        except Exception as exc:
            log.warning("cluster: reconciling node %s failed: %s", info.node_id, exc)
            return
        # And the other way: what is bound to it that it came back without.
        await self._check_node(info.node_id, set(held))

    async def _left(self, node_id: str) -> None:
        why = f"its node {node_id} left the cluster (the agent stopped or its lease lapsed)"
        log.warning("cluster: node %s left", node_id)
        for rid, (on, *_) in list(self._missing.items()):
            if on == node_id:
                del self._missing[rid]
        try:
            bound = await self.bindings.of_node(node_id)
        except Exception as exc:
            log.warning("cluster: bindings of the departed node %s unknown: %s", node_id, exc)
            return
        for rid in bound:
            self._deliver(rid, why)

    async def _reconcile_forever(self) -> None:
        while True:
            # Jittered: replicas started together do not ask every node at the same moment.
            await asyncio.sleep(self.reconcile_s * self._rng.uniform(0.9, 1.1))
            await self.reconcile()

    async def reconcile(self) -> None:
        """One check of every live node, all at once: a slow node holds up only its own."""
        await asyncio.gather(*(self._check_node(n) for n in sorted(self._live)))

    async def _check_node(self, node_id: str, held: set[str] | None = None) -> None:
        """Reports lost what is bound to the node but not there (`held`: its list, if just
        asked). Never raises; gives up on the node at `node_check_s`."""
        try:
            async with asyncio.timeout(self.node_check_s):
                await self._check_node_now(node_id, held)
        except TimeoutError:
            log.warning("cluster: node %s not reconciled within %g s", node_id, self.node_check_s)
        except Exception as exc:
            log.warning("cluster: reconciling node %s failed: %s", node_id, exc)

    async def _check_node_now(self, node_id: str, held: set[str] | None) -> None:
        client = self._clients.get(node_id)
        if client is None or node_id not in self._live:
            return
        before = await self.bindings.of_node_revisions(node_id)
        if held is None:
            held = set(await client.sandbox_ids())
        suspects = {rid: rev for rid, rev in before.items() if rid not in held}
        for rid, (on, *_) in list(self._missing.items()):
            if on == node_id and rid not in suspects:
                del self._missing[rid]
        if not suspects:
            return
        # Asked after the list: a create that finished meanwhile is there now.
        asking = asyncio.Semaphore(RECONCILE_ASKS)
        answers = await asyncio.gather(*(self._ask(client, rid, asking) for rid in suspects))
        # Read again after the node answered: a binding that moved (a resume elsewhere) or
        # was made again meanwhile is not this node's to lose.
        after = await self.bindings.of_node_revisions(node_id)
        now = time.monotonic()
        for (rid, rev), (there, why) in zip(suspects.items(), answers, strict=True):
            if there or after.get(rid) != rev:
                self._missing.pop(rid, None)
                continue
            seen = self._missing.get(rid)
            if seen is None or seen[:2] != (node_id, rev):
                seen = self._missing[rid] = (node_id, rev, now, False)
            if seen[3] or (why is None and now - seen[2] < self.lost_grace_s):
                # Told already; or it may still be on its way there (a create in flight).
                continue
            self._missing[rid] = (node_id, rev, seen[2], True)
            if why is None:
                why = f"not there for {now - seen[2]:.0f} s"
            log.warning("cluster: node %s no longer holds %s: %s", node_id, rid, why)
            self._deliver(rid, f"its node {node_id} no longer has it: {why}")

    async def _ask(
        self, client: RemoteRuntime, sandbox_id: str, asking: asyncio.Semaphore
    ) -> tuple[bool, str | None]:
        """(held, why): the reason the node lost the sandbox when it knows one (its restart
        found the VM gone), asked first: a stale copy in the bucket would make `find` say
        paused. Else whether it holds it after all (running, paused on its disk or in the
        bucket)."""
        async with asking:
            why = await client.lost_reason(sandbox_id)
            if why is not None:
                return False, why
            return await client.find(sandbox_id) is not None, None
