"""A TCP proxy on 127.0.0.1 that cuts the first blob download after some bytes."""

from __future__ import annotations

import asyncio
import contextlib
import re

IO_TIMEOUT_S = 30.0


class CuttingProxy:
    def __init__(self, upstream_port: int, cut_after: int) -> None:
        self.upstream_port = upstream_port
        self.cut_after = cut_after
        self.cuts = 0
        self.ranges: list[str] = []
        self.port = 0
        self._server: asyncio.Server | None = None

    async def __aenter__(self) -> CuttingProxy:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = int(self._server.sockets[0].getsockname()[1])
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(5):
                await self._server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_r, up_w = await asyncio.wait_for(
            asyncio.open_connection("127.0.0.1", self.upstream_port), IO_TIMEOUT_S
        )
        state = {"blob": False}

        async def client_to_upstream() -> None:
            while data := await asyncio.wait_for(reader.read(65536), IO_TIMEOUT_S):
                text = data.decode("latin-1")
                if "/blobs/sha256:" in text:
                    state["blob"] = True
                self.ranges += re.findall(r"(?im)^range:\s*(\S+)", text)
                up_w.write(data)
                await up_w.drain()
            up_w.close()

        async def upstream_to_client() -> None:
            sent = 0
            while data := await asyncio.wait_for(up_r.read(65536), IO_TIMEOUT_S):
                if state["blob"] and self.cuts == 0 and sent + len(data) > self.cut_after:
                    self.cuts += 1
                    writer.write(data[: self.cut_after - sent])
                    await writer.drain()
                    writer.transport.abort()
                    up_w.transport.abort()
                    return
                sent += len(data) if state["blob"] else 0
                writer.write(data)
                await writer.drain()
            writer.close()

        try:
            await asyncio.gather(client_to_upstream(), upstream_to_client())
        except (OSError, TimeoutError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.transport.abort()
            up_w.transport.abort()
