"""Exceptions raised while building guest artifacts and managing templates."""

from __future__ import annotations


class TemplateError(Exception):
    """Base class for template and artifact errors; the message is one line for the user."""


class BuildError(TemplateError):
    """A build step (a command, a download, a missing input) failed."""


class TemplateNotFound(TemplateError, LookupError):
    """No template of that name is registered."""

    def __init__(self, name: str, known: list[str]) -> None:
        self.name = name
        self.known = known
        listing = ", ".join(sorted(known)) if known else "none"
        super().__init__(f"template {name!r} not found (known templates: {listing})")

    def __str__(self) -> str:
        # LookupError would otherwise repr() the message like a dict key.
        return str(self.args[0])


class CatalogError(TemplateError):
    """The catalog file is unreadable or a template definition is invalid."""
