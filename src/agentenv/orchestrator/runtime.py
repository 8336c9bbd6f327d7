"""What the orchestrator needs from whatever runs sandboxes.

The state machine talks only to this protocol, so the single-host ``Node``, a future
snapshot-capable node and a multi-node gateway can all sit behind it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class Placement:
    """Where a running sandbox can be reached."""

    runtime_id: str
    # Host (IP) that forwards every guest port: the slot address for microVMs.
    address: str
    envd_url: str


class RuntimeFailure(Exception):
    """Base class of runtime failures surfaced to the API."""


class Unsupported(RuntimeFailure):
    """The runtime cannot perform this operation (e.g. pause before snapshots exist)."""


class TemplateUnavailable(RuntimeFailure):
    """The runtime has no template by that name."""


class Runtime(Protocol):
    async def start(self) -> None: ...

    async def close(self) -> None: ...

    async def create(
        self, template: str, cpu: int, memory_mb: int, disk_size_mb: int
    ) -> Placement: ...

    async def delete(self, runtime_id: str) -> None: ...

    async def pause(self, runtime_id: str) -> None:
        """Freeze the sandbox into a snapshot and release its VM; may raise ``Unsupported``."""
        ...

    async def resume(self, runtime_id: str) -> Placement:
        """Bring a paused sandbox back; may raise ``Unsupported``."""
        ...

    def is_alive(self, runtime_id: str) -> bool:
        """Whether the runtime still holds this sandbox (used after a server restart)."""
        ...


@dataclass(frozen=True)
class TemplateInfo:
    name: str
    size_mb: int
    created_at: float
    updated_at: float
    cpu: int
    memory_mb: int


class TemplateSource(Protocol):
    def get(self, name: str) -> TemplateInfo:
        """Raises ``TemplateUnavailable`` for an unknown name."""
        ...

    def list(self) -> list[TemplateInfo]: ...

    def delete(self, name: str) -> bool: ...
