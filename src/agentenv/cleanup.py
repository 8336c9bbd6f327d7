"""A sandbox's cleanup stack (after E2B's per-sandbox `Cleanup`): each step of a create pushes
the undo of what it just acquired, and a failure runs the stack in reverse. Every step has a
deadline; a step that fails or overruns is logged and the rest still run; `run` then raises
one `CleanupFailed` naming every step that did not finish. Running empties the stack, so a
second run does nothing, and a run is whole (`aio.whole`): a cancel that arrives meanwhile is
raised once every step has run, so a cancelled create never stops its teardown halfway.

Top-level (it imports only `aio`) so that `snapshot/` as well as `node/` can push onto it."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from agentenv.aio import whole

log = logging.getLogger(__name__)

# How long one undo step may take: killing a VM under TCG, removing a workdir of a few GB.
STEP_TIMEOUT_S = 60.0


class CleanupFailed(Exception):
    """Some undo steps of a sandbox did not finish; `failed` names them."""

    def __init__(self, owner: str, failed: list[str]) -> None:
        super().__init__(f"cleanup of {owner}: {len(failed)} step(s) failed: {', '.join(failed)}")
        self.failed = failed


@dataclass(frozen=True)
class Step:
    name: str
    undo: Callable[[], Awaitable[object]]
    timeout_s: float


class Cleanup:
    """The undo steps of one sandbox, last acquired first."""

    def __init__(self, owner: str) -> None:
        self.owner = owner
        self._steps: list[Step] = []

    def push(
        self,
        name: str,
        undo: Callable[[], Awaitable[object]],
        timeout_s: float = STEP_TIMEOUT_S,
    ) -> None:
        """Record the undo of what was just acquired (push right after acquiring it)."""
        self._steps.append(Step(name, undo, timeout_s))

    @property
    def names(self) -> list[str]:
        """The steps in the order they will run."""
        return [s.name for s in reversed(self._steps)]

    def __len__(self) -> int:
        return len(self._steps)

    def __contains__(self, name: object) -> bool:
        return any(s.name == name for s in self._steps)

    def _take(self, name: str) -> Step | None:
        for i in range(len(self._steps) - 1, -1, -1):
            if self._steps[i].name == name:
                return self._steps.pop(i)
        return None

    def drop(self, name: str) -> bool:
        """Forget the last step called `name` without running it (what it undoes went
        another way, e.g. a pause's QEMU exited by itself); False if there was none."""
        return self._take(name) is not None

    async def release(self, name: str) -> None:
        """Run the last step called `name` now, out of order, and forget it (a pause gives
        its slot back while the rest of the sandbox stays); nothing if there is none."""
        step = self._take(name)
        if step is not None:
            await whole(self._run_steps([step]))

    async def run(self, after_step: Callable[[str], None] | None = None) -> None:
        """Run every step, last pushed first, each under its deadline; raise `CleanupFailed`
        at the end if any failed. A cancel meanwhile is raised after the last step.
        `after_step(name)` is called once each step ended (a test's crash point)."""
        steps, self._steps = self._steps[::-1], []
        await whole(self._run_steps(steps, after_step))

    async def _run_steps(
        self, steps: list[Step], after_step: Callable[[str], None] | None = None
    ) -> None:
        failed: list[str] = []
        for step in steps:
            try:
                async with asyncio.timeout(step.timeout_s):
                    await step.undo()
            except TimeoutError:
                log.error(
                    "cleanup of %s: %s took over %.0fs", self.owner, step.name, step.timeout_s
                )
                failed.append(step.name)
            except Exception:
                log.exception("cleanup of %s: %s failed", self.owner, step.name)
                failed.append(step.name)
            if after_step is not None:
                after_step(step.name)
        if failed:
            raise CleanupFailed(self.owner, failed)
