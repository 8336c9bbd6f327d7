"""The replica side: tunnels through a node's data gateway, for httpx pools and WebSockets.

`GatewayDialer.open` asks a gateway (``host:port``) for a tunnel to one sandbox port and
returns it as an httpcore network stream. `transport` is an httpx transport whose every
connection is such a tunnel (so a pool to one sandbox keeps its keep-alive connections and
its guest-side TLS for `httpsPorts`), and `socket` a connected socket for the `websockets`
client, which takes only sockets.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import ssl
import typing
from dataclasses import dataclass

import httpcore
import httpx

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


class _Prefixed(httpcore.AsyncNetworkStream):
    """A stream whose first bytes were read with the gateway's answer."""

    def __init__(self, stream: httpcore.AsyncNetworkStream, prefix: bytes) -> None:
        self._stream = stream
        self._prefix = prefix

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:  # noqa: ASYNC109
        if self._prefix:
            out, self._prefix = self._prefix[:max_bytes], self._prefix[max_bytes:]
            return out
        return await self._stream.read(max_bytes, timeout)

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:  # noqa: ASYNC109
        await self._stream.write(buffer, timeout)

    async def aclose(self) -> None:
        await self._stream.aclose()

    async def start_tls(
        self,
        ssl_context: ssl.SSLContext,
        server_hostname: str | None = None,
        timeout: float | None = None,  # noqa: ASYNC109 - httpcore's interface
    ) -> httpcore.AsyncNetworkStream:
        # A TLS server speaks only after the client's hello: nothing can be buffered yet.
        assert not self._prefix
        return await self._stream.start_tls(ssl_context, server_hostname, timeout)

    def get_extra_info(self, info: str) -> typing.Any:
        if info == "is_readable" and self._prefix:
            return True
        return self._stream.get_extra_info(info)


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

    async def open(self, gateway: str, sandbox_id: str, port: int) -> httpcore.AsyncNetworkStream:
        """A tunnel to `port` of `sandbox_id`, or `TunnelError` (`TunnelRefused` when the
        gateway said no) within `connect_timeout_s`."""
        host, gateway_port, secure = split_address(gateway)
        backend = httpcore.AnyIOBackend()
        t = self.connect_timeout_s
        try:
            stream = await backend.connect_tcp(host, gateway_port, timeout=t)
        except (httpcore.ConnectError, httpcore.ConnectTimeout, OSError) as exc:
            raise TunnelError(f"data gateway {gateway} is unreachable: {exc}") from exc
        try:
            async with asyncio.timeout(t):
                if secure:
                    verify = self.tls or ssl.create_default_context()
                    stream = await stream.start_tls(verify, server_hostname=host, timeout=t)
                await stream.write(
                    f"CONNECT {sandbox_id}:{port} HTTP/1.1\r\nHost: {sandbox_id}:{port}\r\n"
                    f"Proxy-Authorization: Bearer {self.token}\r\n\r\n".encode("latin-1"),
                    timeout=t,
                )
                buf = b""
                while b"\r\n\r\n" not in buf:
                    chunk = await stream.read(CHUNK, timeout=t)
                    if not chunk:
                        raise TunnelRefused(gateway, 502, "closed the connection unanswered")
                    buf += chunk
                    if len(buf) > MAX_HEAD_BYTES and b"\r\n\r\n" not in buf:
                        raise TunnelRefused(gateway, 502, "sent an over-long answer")
                head, _, rest = buf.partition(b"\r\n\r\n")
                status = _status(head)
                if status != 200:
                    raise TunnelRefused(gateway, status, await _message(stream, head, rest, t))
        except TimeoutError:
            await stream.aclose()
            raise TunnelError(
                f"data gateway {gateway} gave no tunnel to {sandbox_id}:{port} in {t:g}s"
            ) from None
        except (httpcore.NetworkError, httpcore.TimeoutException, ssl.SSLError, OSError) as exc:
            await stream.aclose()
            raise TunnelError(f"data gateway {gateway}: {exc!r}") from exc
        except BaseException:
            await stream.aclose()
            raise
        if self.on_tunnel is not None:
            self.on_tunnel(gateway)
        return _Prefixed(stream, rest) if rest else stream

    def transport(
        self,
        gateway: str,
        sandbox_id: str,
        *,
        limits: httpx.Limits,
        verify: ssl.SSLContext,
    ) -> httpx.AsyncHTTPTransport:
        """An httpx transport whose connections are tunnels to `sandbox_id`'s ports (the
        port of each request's URL; its host is not used)."""
        transport = httpx.AsyncHTTPTransport(verify=verify, limits=limits, trust_env=False)
        # httpx takes no network backend, its connection pool does: the transport's own
        # pool (what `handle_async_request` sends through, and maps httpcore's errors of)
        # is replaced by one built the same way over the tunnels.
        assert isinstance(transport._pool, httpcore.AsyncConnectionPool)
        transport._pool = httpcore.AsyncConnectionPool(
            ssl_context=verify,
            max_connections=limits.max_connections,
            max_keepalive_connections=limits.max_keepalive_connections,
            keepalive_expiry=limits.keepalive_expiry,
            network_backend=_TunnelBackend(self, gateway, sandbox_id),
        )
        return transport

    async def socket(
        self, gateway: str, sandbox_id: str, port: int
    ) -> tuple[socket.socket, asyncio.Task[None]]:
        """A connected socket whose peer is the tunnel, and the task that relays between
        them (it ends when the socket is closed or the tunnel ends; cancel it to cut)."""
        stream = await self.open(gateway, sandbox_id, port)
        ours, theirs = socket.socketpair()
        try:
            reader, writer = await asyncio.open_connection(sock=ours, limit=CHUNK)
        except BaseException:
            ours.close()
            theirs.close()
            await stream.aclose()
            raise
        task = asyncio.create_task(_relay(stream, reader, writer), name=f"tunnel-{sandbox_id}")
        return theirs, task


def _status(head: bytes) -> int:
    parts = head.split(b"\r\n", 1)[0].split(b" ", 2)
    if len(parts) < 2 or not parts[1].isdigit():
        raise TunnelRefused("?", 502, f"not an HTTP answer: {head[:100]!r}")
    return int(parts[1])


async def _message(
    stream: httpcore.AsyncNetworkStream, head: bytes, body: bytes, per_read_s: float
) -> str:
    """The refusal's `message` (its JSON body), read as far as its Content-Length says."""
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length" and value.strip().isdigit():
            length = min(int(value.strip()), MAX_HEAD_BYTES)
    with contextlib.suppress(Exception):
        while len(body) < length:
            chunk = await stream.read(length - len(body), timeout=per_read_s)
            if not chunk:
                break
            body += chunk
    try:
        return str(json.loads(body)["message"])
    except (ValueError, KeyError, TypeError):
        return body[:200].decode("latin-1", "replace") or head.split(b"\r\n", 1)[0].decode(
            "latin-1"
        )


class _TunnelBackend(httpcore.AsyncNetworkBackend):
    def __init__(self, dialer: GatewayDialer, gateway: str, sandbox_id: str) -> None:
        self._dialer = dialer
        self._gateway = gateway
        self._sandbox_id = sandbox_id

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,  # noqa: ASYNC109 - httpcore's interface
        local_address: str | None = None,
        socket_options: typing.Iterable[httpcore.SOCKET_OPTION] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        try:
            return await self._dialer.open(self._gateway, self._sandbox_id, port)
        except TunnelError as exc:
            # httpx maps httpcore's errors only: no tunnel is a failed connect.
            raise httpcore.ConnectError(str(exc)) from exc

    async def connect_unix_socket(
        self,
        path: str,
        timeout: float | None = None,  # noqa: ASYNC109 - httpcore's interface
        socket_options: typing.Iterable[httpcore.SOCKET_OPTION] | None = None,
    ) -> httpcore.AsyncNetworkStream:  # pragma: no cover - never asked for
        raise httpcore.ConnectError("tunnels carry TCP only")

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


async def _relay(
    stream: httpcore.AsyncNetworkStream,
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
) -> None:
    def no_half_close() -> bool:
        # The tunnel stream cannot be half-closed: the socket's user closing its end (or
        # failing) is the relay's end. The guest's side ending half-closes the socket: its
        # user reads EOF, and closes its end.
        return False

    to_socket = stream_flow(reader, writer, CHUNK)  # its write and half-close
    try:
        await both_ways(
            Flow(lambda: reader.read(CHUNK), stream.write, no_half_close),
            Flow(lambda: stream.read(CHUNK), to_socket.write, to_socket.end),
        )
    finally:
        writer.close()
        with contextlib.suppress(Exception):
            await stream.aclose()
