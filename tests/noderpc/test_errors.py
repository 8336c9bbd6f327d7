"""The error allow-list on its own: what a `Failure` detail may and may not turn into."""

from __future__ import annotations

import asyncio

import pytest
from connectrpc.code import Code
from connectrpc.errors import ConnectError

from agentenv.contract import errors as api_errors
from agentenv.contract import runtime as rt
from agentenv.noderpc.client import RemoteRuntime
from agentenv.noderpc.errors import (
    KINDS,
    NodeError,
    NodeUnreachable,
    allowed_kind,
    failure_of,
    from_failure,
    to_connect,
)
from agentenv.noderpc.gen import node_pb as pb


@pytest.mark.parametrize(
    "kind", ["SystemExit", "KeyboardInterrupt", "Exception", "ValueError", "__class__", "", "os"]
)
def test_names_outside_the_allow_list_make_nothing(kind: str) -> None:
    assert from_failure(pb.Failure(kind=kind, message="x")) is None


def test_allow_list_holds_only_contract_classes() -> None:
    for cls in KINDS.values():
        assert cls.__module__ in ("agentenv.contract.errors", "agentenv.contract.runtime")


def test_builtin_errors_are_not_sent_as_kinds() -> None:
    assert allowed_kind(ValueError("x")) is None
    assert allowed_kind(TimeoutError("x")) is None
    assert allowed_kind(api_errors.SandboxLost("a", "b")) is api_errors.SandboxLost
    assert allowed_kind(NodeUnreachable("x", 1)) is api_errors.Unavailable


def test_a_failure_survives_encoding() -> None:
    err = to_connect(api_errors.Unavailable("full", 9), api_errors.Unavailable)
    assert err.code is Code.UNAVAILABLE
    # What the client decodes is the serialized detail, not the object the server made.
    detail = pb.Failure.from_binary(err.details[0].message_bytes)
    back = from_failure(detail)
    assert type(back) is api_errors.Unavailable
    assert (back.message, back.retry_after) == ("full", 9)
    assert failure_of(err) is not None
    assert to_connect(rt.Lost("gone"), rt.Lost).code is Code.FAILED_PRECONDITION


async def test_a_kind_this_client_does_not_know_is_a_node_error() -> None:
    remote = RemoteRuntime("http://node-a:7000", "tok")
    err = ConnectError(
        Code.UNAVAILABLE,
        "m",
        details=[pb.Failure(kind="NewerNodeFailure", message="something new")],
    )
    exc = remote._translate("Create", err, 1.0)
    assert type(exc) is NodeError
    assert "NewerNodeFailure" in str(exc) and "something new" in str(exc)
    assert "http://node-a:7000" in str(exc)
    # Without a detail, UNAVAILABLE is the transport's: the node is unreachable.
    plain = remote._translate("Create", ConnectError(Code.UNAVAILABLE, "reset"), 1.0)
    assert isinstance(plain, NodeUnreachable)
    assert asyncio.current_task() is not None
