"""agentenv.cleanup.Cleanup: reverse order, every step runs past a failure or an overrun, one
summary error, and a second run does nothing."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from agentenv.cleanup import Cleanup, CleanupFailed


async def test_runs_in_reverse_and_empties() -> None:
    ran: list[str] = []
    stack = Cleanup("i1")

    def step(name: str) -> Callable[[], Awaitable[None]]:
        async def undo() -> None:
            ran.append(name)

        return undo

    for name in ("workdir", "layer", "slot", "vm"):
        stack.push(name, step(name))
    assert stack.names == ["vm", "slot", "layer", "workdir"]
    # `after_step` sees each step once it ended, in the order they ran (a crash point).
    ended: list[str] = []
    await stack.run(lambda name: ended.append(f"{name}:{len(ran)}"))
    assert ran == ["vm", "slot", "layer", "workdir"]
    assert ended == ["vm:1", "slot:2", "layer:3", "workdir:4"]
    assert len(stack) == 0
    await stack.run()
    assert ran == ["vm", "slot", "layer", "workdir"]


async def test_failures_and_overruns_do_not_stop_the_rest() -> None:
    ran: list[str] = []
    never = asyncio.Event()
    stack = Cleanup("i2")

    async def first() -> None:
        ran.append("first")

    async def broken() -> None:
        raise OSError("gone wrong")

    async def stuck() -> None:
        await never.wait()

    stack.push("first", first)
    stack.push("broken", broken)
    stack.push("stuck", stuck, timeout_s=0.01)
    with pytest.raises(CleanupFailed) as info:
        await stack.run()
    assert info.value.failed == ["stuck", "broken"]
    assert ran == ["first"]
    assert "i2" in str(info.value)


async def test_a_cancel_mid_run_still_runs_every_step() -> None:
    """A cancelled create's teardown is not cut in half: the cancel comes after the last
    step."""
    ran: list[str] = []
    started = asyncio.Event()
    release = asyncio.Event()
    stack = Cleanup("i3")

    async def first() -> None:
        ran.append("first")

    async def slow() -> None:
        started.set()
        await release.wait()
        ran.append("slow")

    stack.push("first", first)
    stack.push("slow", slow)
    task = asyncio.create_task(stack.run())
    await started.wait()
    task.cancel()
    await asyncio.sleep(0)
    assert not task.done()
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert ran == ["slow", "first"]
    assert len(stack) == 0


async def test_release_runs_one_step_now_and_drop_forgets_one() -> None:
    """A pause gives its slot back out of order (`release`) and forgets its exited QEMU
    (`drop`); delete then runs only what is left, once each."""
    ran: list[str] = []
    stack = Cleanup("i4")

    def step(name: str) -> Callable[[], Awaitable[None]]:
        async def undo() -> None:
            ran.append(name)

        return undo

    for name in ("workdir", "slot", "vm"):
        stack.push(name, step(name))
    await stack.release("slot")
    assert ran == ["slot"]
    assert stack.drop("vm")
    assert not stack.drop("vm")
    await stack.release("slot")
    assert ran == ["slot"]
    stack.push("slot", step("slot again"))
    assert "slot" in stack
    await stack.run()
    assert ran == ["slot", "slot again", "workdir"]
    assert len(stack) == 0


async def test_release_of_a_failing_step_raises_and_forgets_it() -> None:
    stack = Cleanup("i5")

    async def broken() -> None:
        raise OSError("gone")

    stack.push("slot", broken)
    with pytest.raises(CleanupFailed) as info:
        await stack.release("slot")
    assert info.value.failed == ["slot"]
    assert "slot" not in stack
