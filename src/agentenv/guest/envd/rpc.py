"""Glue between envd's logic and connectrpc: error mapping, the acting user, the JSON codec."""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol, TypeVar

from connectrpc.code import Code
from connectrpc.codec import proto_json_codec
from connectrpc.errors import ConnectError

from .errors import EnvdFault
from .state import EnvdState
from .users import User, lookup_user, user_from_authorization

log = logging.getLogger("agentenv.envd")

T = TypeVar("T")
F = TypeVar("F", bound=Callable[..., Awaitable[Any]])
G = TypeVar("G", bound=Callable[..., AsyncIterator[Any]])


class HasHeaders(Protocol):
    @property
    def request_headers(self) -> Any: ...


def to_connect(exc: EnvdFault) -> ConnectError:
    return ConnectError(Code(exc.code), exc.message)


def unary(fn: F) -> F:
    """Turns envd's typed errors into Connect errors for a unary handler."""

    @functools.wraps(fn)
    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return await fn(*args, **kwargs)
        except EnvdFault as exc:
            raise to_connect(exc) from None
        except (FileNotFoundError, NotADirectoryError) as exc:
            raise ConnectError(Code.NOT_FOUND, f"path not found: {exc.filename}") from None
        except PermissionError as exc:
            raise ConnectError(
                Code.PERMISSION_DENIED, f"permission denied: {exc.filename}"
            ) from None
        except ConnectError:
            raise
        except Exception as exc:
            log.exception("%s failed", fn.__qualname__)
            raise ConnectError(Code.INTERNAL, f"{type(exc).__name__}: {exc}") from None

    return wrapper  # type: ignore[return-value]


def streaming(fn: G) -> G:
    """The same for server-streaming handlers (async generators)."""

    @functools.wraps(fn)
    async def wrapper(*args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        try:
            async for item in fn(*args, **kwargs):
                yield item
        except EnvdFault as exc:
            raise to_connect(exc) from None
        except (ConnectError, GeneratorExit, asyncio.CancelledError):
            raise
        except Exception as exc:
            log.exception("%s failed", fn.__qualname__)
            raise ConnectError(Code.INTERNAL, f"{type(exc).__name__}: {exc}") from None

    return wrapper  # type: ignore[return-value]


def acting_user(state: EnvdState, ctx: HasHeaders) -> User:
    name = user_from_authorization(ctx.request_headers.get("authorization"))
    return lookup_user(name or state.default_user)


def timeout_seconds(ctx: Any) -> float | None:
    ms = ctx.timeout_ms
    return None if ms is None else float(ms) / 1000.0


class StrictJSONCodec:
    """connectrpc's JSON codec, but a body that does not parse is the client's error.

    connectrpc lets the parser's exception escape, which becomes `unknown` plus a server
    traceback; clients must get `invalid_argument`.
    """

    def __init__(self) -> None:
        self._inner = proto_json_codec()

    def name(self) -> str:
        return str(self._inner.name())

    def encode(self, message: Any) -> bytes:
        return bytes(self._inner.encode(message))

    def decode(self, data: bytes | bytearray, message_class: type[T]) -> T:
        try:
            return self._inner.decode(data, message_class)  # type: ignore[no-any-return]
        except ConnectError:
            raise
        except Exception as exc:
            raise ConnectError(Code.INVALID_ARGUMENT, f"invalid request body: {exc}") from None
