"""Small shared pieces of the cluster tests."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from agentenv.cluster.etcd import Etcd
from agentenv.cluster.membership import NodeRegistration

from .register_node import node_info

__all__ = ["node_info", "registered", "wait_until"]


async def wait_until(
    condition: Callable[[], Awaitable[bool]], timeout_s: float, interval_s: float = 0.1
) -> float:
    """Seconds until `condition()` held; fails the test after `timeout_s`."""
    started = time.monotonic()
    while True:
        if await condition():
            return time.monotonic() - started
        if time.monotonic() - started > timeout_s:
            raise AssertionError(f"condition not met within {timeout_s} s")
        await asyncio.sleep(interval_s)


async def registered(etcd: Etcd, node_id: str, ttl_s: int = 2) -> NodeRegistration:
    registration = NodeRegistration(etcd, node_info(node_id), ttl_s=ttl_s)
    await registration.start()
    return registration
