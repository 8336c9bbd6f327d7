"""The replica side: tunnels through a node's data gateway, for the proxy's pools and
WebSockets.

`GatewayDialer.open` asks a gateway (``[tls://]host:port``) for a tunnel to one sandbox port
and returns it as an asyncio stream pair (the proxy's HTTP pools keep such tunnels alive as
their connections, with the guest-side TLS of `httpsPorts` started over them); `socket` is a
connected socket for the `websockets` client, which takes only sockets.
"""

from __future__ import annotations

import asyncio
import json
import socket
import ssl
import typing
from dataclasses import dataclass

from agentenv.pump import Flow, both_ways, stream_flow

MAX_HEAD_BYTES = 16 * 1024
CONNECT_TIMEOUT_S = 10.0
CHUNK = 256 * 1024


class TunnelError(Exception):
    """No tunnel: the gateway could not be reached, or did not answer in time."""


class TunnelRefused(TunnelError):
    """The gateway answered, and not with a tunnel (its status and message)."""

    def __init__(self, gateway: str, status: int, message: str) -> None:
        super().__init__(f"data gateway {gateway}: {status} {message}")
        self.status = status
        self.message = message


TLS_SCHEME = "tls://"


def split_address(gateway: str) -> tuple[str, int, bool]:
    """``[tls://]HOST:PORT`` -> host, port, whether the gateway serves TLS."""
    secure = gateway.startswith(TLS_SCHEME)
    rest = gateway[len(TLS_SCHEME) :] if secure else gateway
    host, sep, port = rest.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise TunnelError(f"gateway address {gateway!r}: expected [tls://]HOST:PORT")
    return host.strip("[]"), int(port), secure


@dataclass(frozen=True)
class GatewayDialer:
    """Opens tunnels with the cluster's node token. A gateway published as ``tls://`` is
    spoken to in TLS, its certificate verified against `tls` (the node RPC's CA; None: the
    system's store); a plain ``HOST:PORT`` one in plain TCP."""

    token: str
    tls: ssl.SSLContext | None = None
    connect_timeout_s: float = CONNECT_TIMEOUT_S
    # Told the gateway of every tunnel opened (the proxy counts them per node).
    on_tunnel: typing.Callable[[str], None] | None = None

    async def open(
        self, gateway: str, sandbox_id: str, port: int
    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """A tunnel to `port` of `sandbox_id`, as an asyncio stream pair, or `TunnelError`
        (`TunnelRefused` when the gateway said no) within `connect_timeout_s`."""
        host, gateway_port, secure = split_address(gateway)
        t = self.connect_timeout_s
        verify = (self.tls or ssl.create_default_context()) if secure else None
        try:
            async with asyncio.timeout(t):
                reader, writer = await asyncio.open_connection(
                    host, gateway_port, ssl=verify, limit=CHUNK
                )
        except TimeoutError:
            raise TunnelError(
                f"data gateway {gateway} is unreachable: no answer in {t:g}s"
            ) from None
        except OSError as exc:
            raise TunnelError(f"data gateway {gateway} is unreachable: {exc}") from exc
        try:
            async with asyncio.timeout(t):
                writer.write(
                    f"CONNECT {sandbox_id}:{port} HTTP/1.1\r\nHost: {sandbox_id}:{port}\r\n"
                    f"Proxy-Authorization: Bearer {self.token}\r\n\r\n".encode("latin-1")
                )
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except asyncio.IncompleteReadError:
                    raise TunnelRefused(gateway, 502, "closed the connection unanswered") from None
                except asyncio.LimitOverrunError:
                    raise TunnelRefused(gateway, 502, "sent an over-long answer") from None
                if len(head) > MAX_HEAD_BYTES:
                    raise TunnelRefused(gateway, 502, "sent an over-long answer")
                status = _status(head)
                if status != 200:
                    raise TunnelRefused(gateway, status, await _message(reader, head))
        except TimeoutError:
            writer.close()
            raise TunnelError(
                f"data gateway {gateway} gave no tunnel to {sandbox_id}:{port} in {t:g}s"
            ) from None
        except TunnelError:
            writer.close()
            raise
        except OSError as exc:
            writer.close()
            raise TunnelError(f"data gateway {gateway}: {exc!r}") from exc
        except BaseException:
            writer.close()
            raise
        if self.on_tunnel is not None:
            self.on_tunnel(gateway)
        # What the guest sent after the answer's head stays in `reader`'s buffer.
        return reader, writer

    async def socket(
        self, gateway: str, sandbox_id: str, port: int
    ) -> tuple[socket.socket, asyncio.Task[None]]:
        """A connected socket whose peer is the tunnel, and the task that relays between
        them (it ends when the socket is closed or the tunnel ends; cancel it to cut)."""
        tunnel = await self.open(gateway, sandbox_id, port)
        ours, theirs = socket.socketpair()
        try:
            reader, writer = await asyncio.open_connection(sock=ours, limit=CHUNK)
        except BaseException:
            ours.close()
            theirs.close()
            tunnel[1].close()
            raise
        task = asyncio.create_task(_relay(tunnel, reader, writer), name=f"tunnel-{sandbox_id}")
        return theirs, task


def _status(head: bytes) -> int:
    parts = head.split(b"\r\n", 1)[0].split(b" ", 2)
    if len(parts) < 2 or not parts[1].isdigit():
        raise TunnelRefused("?", 502, f"not an HTTP answer: {head[:100]!r}")
    return int(parts[1])


async def _message(reader: asyncio.StreamReader, head: bytes) -> str:
    """The refusal's `message` (its JSON body), read as far as its Content-Length says."""
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length" and value.strip().isdigit():
            length = min(int(value.strip()), MAX_HEAD_BYTES)
    try:
        body = await reader.readexactly(length)
    except asyncio.IncompleteReadError as short:
        body = short.partial
    except OSError:
        body = b""
    try:
        return str(json.loads(body)["message"])
    except (ValueError, KeyError, TypeError):
        return body[:200].decode("latin-1", "replace") or head.split(b"\r\n", 1)[0].decode(
            "latin-1"
        )


async def _relay(
    tunnel: tuple[asyncio.StreamReader, asyncio.StreamWriter],
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
) -> None:
    def no_half_close() -> bool:
        # The socket's user closing its end (or failing) is the relay's end: the tunnel is
        # not half-closed for it (over TLS it cannot be). The guest's side ending
        # half-closes the socket: its user reads EOF, and closes its end.
        return False

    to_socket = stream_flow(tunnel[0], writer, CHUNK)  # its write and half-close
    to_tunnel = stream_flow(reader, tunnel[1], CHUNK)
    try:
        await both_ways(
            Flow(to_tunnel.read, to_tunnel.write, no_half_close),
            to_socket,
        )
    finally:
        writer.close()
        tunnel[1].close()
