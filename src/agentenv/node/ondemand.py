"""Templates a node builds on first use: ``code-interpreter-v1`` (and its alias).

The E2B code-interpreter SDKs create from ``code-interpreter-v1`` without any setup step, so
a create that names it on a node that does not have it (current) starts its build here and is
answered ``503`` with ``Retry-After``: the SDKs retry that by themselves, and the message
says what is happening. The build runs once per node in the background (the wheels, the
image from `base`'s, then the template snapshot in the default shape, so the create that
follows is a resume with the kernel running), not inside any request: a client's timeout
never cancels it and no request waits on it without a deadline. A build that failed answers
the next create with its error (500) and is started again by the create after it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from agentenv import snapshot as snaps
from agentenv.config import Settings
from agentenv.contract.errors import CreateFailed, Unavailable
from agentenv.template import code_interpreter as ci
from agentenv.template.cache import input_key
from agentenv.template.catalog import TemplateCatalog, TemplateNotFound

log = logging.getLogger(__name__)

# What a create is told to wait before it asks again (a build takes ~1-2 min under TCG).
RETRY_AFTER_S = 15


class OnDemandTemplates:
    def __init__(self, settings: Settings, published: Callable[[], Awaitable[None]]) -> None:
        self.settings = settings
        # Called once a build registered its template: a node agent republishes its catalog.
        self.published = published
        self._build: asyncio.Task[None] | None = None
        self._failed: str | None = None
        # The build key a current template has: its inputs (source digests, the base's key)
        # are hashed once per process, not on every create that names it.
        self._key: str | None = None

    async def resolve(self, template: str) -> str:
        """The catalog name `template` stands for, once it is there and current; raises
        `Unavailable` (503 + Retry-After) while it is being built."""
        name = ci.resolve(template)
        if name != ci.NAME:
            return template
        if self._build is None and await asyncio.to_thread(self._current):
            return name
        if self._failed is not None and self._build is None:
            why, self._failed = self._failed, None
            raise CreateFailed(f"template {name!r} could not be built: {why}")
        if self._build is None:
            log.info("template %s: not built here yet, building it for its first use", name)
            self._build = asyncio.create_task(self._run(), name=f"build {name}")
        raise Unavailable(
            f"template {name!r} is being built on this node for its first use (about a "
            f"minute or two; `aenv setup --with-code-interpreter` builds it ahead): retry in "
            f"{RETRY_AFTER_S} s",
            RETRY_AFTER_S,
        )

    def _current(self) -> bool:
        try:
            tpl = TemplateCatalog(self.settings).get(ci.NAME)
        except TemplateNotFound:
            return False
        if self._key is None:
            self._key = input_key(ci.code_interpreter_inputs())
        return tpl.build_key == self._key

    async def _run(self) -> None:
        s = self.settings
        try:
            await asyncio.to_thread(ci.ensure_code_interpreter, s, None)
            if s.snapshots:
                await snaps.ensure_template_snapshot(s, ci.NAME, s.default_memory_mb, s.default_cpu)
            await self.published()
            log.info("template %s: built for its first use", ci.NAME)
        except Exception as exc:
            log.error("template %s: the first-use build failed: %s", ci.NAME, exc)
            self._failed = str(exc) or type(exc).__name__
        finally:
            self._build = None

    async def close(self) -> None:
        """Stops a build in progress (its artifact cache and snapshot writes are atomic)."""
        task, self._build = self._build, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
