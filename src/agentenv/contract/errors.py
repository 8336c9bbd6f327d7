"""Typed failures of sandbox operations; each carries the HTTP status the API answers with."""

from __future__ import annotations


class OrchestratorError(Exception):
    status = 500
    # Seconds after which the same request may succeed (a `Retry-After` header), if known.
    retry_after: int | None = None

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class BadRequest(OrchestratorError):
    status = 400


class SandboxNotFound(OrchestratorError):
    status = 404

    def __init__(self, sandbox_id: str) -> None:
        super().__init__(f"sandbox {sandbox_id!r} not found")
        self.sandbox_id = sandbox_id


class SandboxLost(SandboxNotFound):
    """Gone for good, not deleted by anyone: its VM died (or a restart found it dead)."""

    def __init__(self, sandbox_id: str, why: str) -> None:
        OrchestratorError.__init__(self, f"sandbox {sandbox_id} was lost: {why}")
        self.sandbox_id = sandbox_id


class TemplateNotFound(OrchestratorError):
    status = 404

    def __init__(self, name: str, message: str | None = None) -> None:
        super().__init__(message or f"template {name!r} not found")
        self.name = name


class Conflict(OrchestratorError):
    status = 409


class NotSupported(OrchestratorError):
    status = 501


class CreateFailed(OrchestratorError):
    status = 500


class OperationFailed(OrchestratorError):
    """An operation on an existing sandbox (pause, resume, snapshot, fork) failed for a reason
    of the host's; the message says which operation and why."""

    status = 500


class Unavailable(OrchestratorError):
    """No capacity for this now (a node limit or a full start queue); nothing was made."""

    status = 503

    def __init__(self, message: str, retry_after: int | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class InsufficientStorage(OrchestratorError):
    """The data dir ran out of space (ENOSPC) during the operation; what it made is gone."""

    status = 507


class TooManyRequests(OrchestratorError):
    """A team's own limit (concurrent sandboxes, create rate) refused this; nothing was made."""

    status = 429

    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__(message)
        self.retry_after = retry_after
