"""`python serve_memory.py PORT TOKEN`: a node RPC server over `MemoryRuntime`, as its own
process, so tests can SIGKILL it and start another on the same port."""

from __future__ import annotations

import asyncio
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1]))

from agentenv.noderpc.server import NodeServer
from noderpc.memruntime import MemoryRuntime


async def main(port: int, token: str) -> None:
    server = NodeServer(MemoryRuntime(), "127.0.0.1", port, token, heartbeat_s=0.5)
    await server.start()
    print(f"listening {server.port}", flush=True)
    await server.wait()


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    asyncio.run(main(int(sys.argv[1]), sys.argv[2]))
