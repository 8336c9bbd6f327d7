"""What every control-plane route module shares: the manager, the keys, the template source
and the sandbox domain."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from agentenv.api.keys import KeyRing
from agentenv.contract.runtime import TemplateSource
from agentenv.control.sandboxes import SandboxManager


@dataclass
class ControlContext:
    manager: SandboxManager
    keys: KeyRing
    templates: TemplateSource
    domain: str | None = None
    _idem_locks: dict[tuple[str, str], asyncio.Lock] = field(default_factory=dict)
