"""What an etcd client error means: one the member causes (refused, UNAVAILABLE, no answer
in time: `retryable`, so the call moves to the next endpoint) or one the request causes; a
lease etcd no longer has; and the short description errors name. Split from `etcd.py`."""

from __future__ import annotations

from typing import Any

import aetcd
from aetcd import rpc as grpc  # grpc's StatusCode and aio errors, as aetcd re-exports them

# gRPC codes that say "this member cannot answer now", not "the request is wrong".
RETRY_CODES = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.ABORTED,
        grpc.StatusCode.CANCELLED,
        grpc.StatusCode.UNKNOWN,
    }
)


def describe(error: BaseException) -> str:
    if isinstance(error, TimeoutError):
        return "no answer in time"
    cause = error.__cause__
    if isinstance(cause, grpc.AioRpcError):
        return f"{cause.code().name}: {cause.details()}"
    if isinstance(error, grpc.AioRpcError):
        return f"{error.code().name}: {error.details()}"
    return f"{type(error).__name__}: {error}"


def grpc_code(error: BaseException) -> Any:
    for candidate in (error, error.__cause__):
        if isinstance(candidate, grpc.AioRpcError):
            return candidate.code()
    return None


def lease_missing(error: BaseException) -> bool:
    return grpc_code(error) == grpc.StatusCode.NOT_FOUND and "lease" in str(error)


def retryable(error: BaseException) -> bool:
    """True when the error says something about the member, not about the request."""
    if isinstance(error, TimeoutError | aetcd.exceptions.WatchTimeoutError):
        return True
    if isinstance(error, aetcd.ConnectionFailedError | aetcd.ConnectionTimeoutError):
        return True
    if isinstance(error, aetcd.ClientError | grpc.AioRpcError):
        code = grpc_code(error)
        # aetcd wraps a few non-gRPC failures of a broken channel without a code.
        return code is None or code in RETRY_CODES
    return False
