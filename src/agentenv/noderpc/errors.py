"""How the contract's failures cross the RPC: a fixed allow-list of classes, each sent as a
`Failure` error detail (class name, message, retry hint, attributes) and raised again as the
same class on the caller's side. No other name is ever turned into a class."""

from __future__ import annotations

from connectrpc.code import Code
from connectrpc.errors import ConnectError

from agentenv.contract import errors as api_errors
from agentenv.contract import runtime as rt

from .convert import opt_int
from .gen import node_pb as pb

# Most specific first is not needed: the server walks the raised class's MRO and sends the
# first allow-listed class it meets, so a node-side subclass travels as its contract parent.
_ALLOWED: tuple[type[Exception], ...] = (
    api_errors.OrchestratorError,
    api_errors.BadRequest,
    api_errors.SandboxNotFound,
    api_errors.SandboxLost,
    api_errors.TemplateNotFound,
    api_errors.Conflict,
    api_errors.NotSupported,
    api_errors.CreateFailed,
    api_errors.Unavailable,
    api_errors.InsufficientStorage,
    api_errors.TooManyRequests,
    rt.RuntimeFailure,
    rt.Unsupported,
    rt.TemplateUnavailable,
    rt.TagUnavailable,
    rt.Lost,
    rt.GuestFailed,
)
KINDS: dict[str, type[Exception]] = {cls.__name__: cls for cls in _ALLOWED}
# String attributes some failures carry besides their message.
_FIELDS = ("sandbox_id", "name")

_CODES: dict[int, Code] = {
    400: Code.INVALID_ARGUMENT,
    404: Code.NOT_FOUND,
    409: Code.ALREADY_EXISTS,
    429: Code.RESOURCE_EXHAUSTED,
    501: Code.UNIMPLEMENTED,
    503: Code.UNAVAILABLE,
    507: Code.RESOURCE_EXHAUSTED,
}


class NodeUnreachable(api_errors.Unavailable):
    """The node did not answer: refused, reset, or silent past the call's deadline. Nothing
    is known of what the call did there. An `Unavailable`, so the API answers 503."""


class NodeError(api_errors.OrchestratorError):
    """The node failed the call with something outside the contract (its message says what)."""

    status = 500


def allowed_kind(exc: BaseException) -> type[Exception] | None:
    for cls in type(exc).__mro__:
        if cls in _ALLOWED:
            return cls
    return None


def to_connect(exc: Exception, kind: type[Exception]) -> ConnectError:
    """A contract failure as the Connect error the server sends."""
    if isinstance(exc, api_errors.OrchestratorError):
        message = exc.message
        retry_after = exc.retry_after
        code = _CODES.get(exc.status, Code.INTERNAL)
    else:
        message = str(exc)
        retry_after = None
        codes: dict[type[Exception], Code] = {
            rt.Unsupported: Code.UNIMPLEMENTED,
            rt.TemplateUnavailable: Code.NOT_FOUND,
            rt.TagUnavailable: Code.NOT_FOUND,
            rt.Lost: Code.FAILED_PRECONDITION,
            rt.GuestFailed: Code.ABORTED,
        }
        code = codes.get(kind, Code.INTERNAL)
    fields = {f: v for f in _FIELDS if isinstance(v := getattr(exc, f, None), str)}
    detail = pb.Failure(kind=kind.__name__, message=message, retry_after=retry_after, fields=fields)
    return ConnectError(code, message, details=[detail])


def failure_of(err: ConnectError) -> pb.Failure | None:
    for detail in err.details:
        if detail.type_name == "agentenv.node.v1.Failure":
            value = detail.value(pb.Failure)
            if isinstance(value, pb.Failure):
                return value
    return None


def from_failure(failure: pb.Failure) -> Exception | None:
    """The exception a `Failure` names, or None if its kind is not on the allow-list."""
    cls = KINDS.get(failure.kind)
    if cls is None:
        return None
    if issubclass(cls, api_errors.OrchestratorError):
        # Some constructors build their message from parts (`SandboxLost(id, why)`): make
        # the instance without them and give it the message the server sent, verbatim.
        exc: Exception = cls.__new__(cls)
        api_errors.OrchestratorError.__init__(exc, failure.message)  # type: ignore[arg-type]
        retry_after = opt_int(failure, "retry_after")
        if retry_after is not None:
            exc.retry_after = retry_after  # type: ignore[attr-defined]
    else:
        exc = cls(failure.message)
    for name, value in failure.fields.items():
        if name in _FIELDS:
            setattr(exc, name, value)
    return exc
