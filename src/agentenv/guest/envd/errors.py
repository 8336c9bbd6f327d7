"""Typed errors of envd's own logic, mapped to Connect codes and HTTP statuses at the edges."""

from __future__ import annotations


class EnvdFault(Exception):
    """A request envd refuses; `code` is the Connect code name, `status` the HTTP status."""

    code = "internal"
    status = 500

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidArgument(EnvdFault):
    code = "invalid_argument"
    status = 400


class NotFound(EnvdFault):
    code = "not_found"
    status = 404


class AlreadyExists(EnvdFault):
    code = "already_exists"
    status = 409


class PermissionDenied(EnvdFault):
    code = "permission_denied"
    status = 403


class Unauthenticated(EnvdFault):
    code = "unauthenticated"
    status = 401


class FailedPrecondition(EnvdFault):
    code = "failed_precondition"
    status = 400


class ResourceExhausted(EnvdFault):
    code = "resource_exhausted"
    status = 507
