"""A node agent reduced to its membership, for tests that kill or pause a real process:

    python register_node.py ENDPOINTS PREFIX NODE_ID TTL_S

prints `registered <lease id hex>` once registered, keeps heartbeating, logs to stderr, and
exits by itself after LIFETIME_S so a test that forgets it leaves nothing running for long.
"""

from __future__ import annotations

import asyncio
import logging
import sys

from agentenv.cluster.etcd import Etcd
from agentenv.cluster.locations import Locations
from agentenv.cluster.membership import Capacity, Load, NodeInfo, NodeRegistration

LIFETIME_S = 120.0


def node_info(node_id: str) -> NodeInfo:
    return NodeInfo(
        node_id=node_id,
        rpc_url=f"http://127.0.0.1:1/{node_id}",
        address="127.0.0.1",
        capacity=Capacity(cpus=2, memory_mb=4096, slots=16),
        load=Load(free_memory_mb=4096, running=0, free_slots=16),
        version="test",
    )


async def main(endpoints: str, prefix: str, node_id: str, ttl_s: int) -> None:
    async with Etcd(endpoints, prefix=prefix) as etcd:
        registration = NodeRegistration(etcd, node_info(node_id), ttl_s=ttl_s)
        await registration.start()
        await Locations(etcd, registration).add("template", "base")
        print(f"registered {registration.lease_id:x}", flush=True)
        await asyncio.sleep(LIFETIME_S)
        await registration.stop()


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])))
