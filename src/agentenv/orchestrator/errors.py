"""Typed failures of sandbox operations; each carries the HTTP status the API answers with."""

from __future__ import annotations


class OrchestratorError(Exception):
    status = 500

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


class TemplateNotFound(OrchestratorError):
    status = 404

    def __init__(self, name: str) -> None:
        super().__init__(f"template {name!r} not found")
        self.name = name


class Conflict(OrchestratorError):
    status = 409


class NotSupported(OrchestratorError):
    status = 501


class CreateFailed(OrchestratorError):
    status = 500
