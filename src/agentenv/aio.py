"""asyncio helpers for work that must not be cut in half by a cancel.

A cancel delivered while `asyncio.to_thread` runs raises at once, but the thread runs on: a
reference taken there lands after the caller has already undone what it had. And a cleanup
cancelled halfway leaves the rest of what it was releasing. Both are made whole here; the
cancel is raised once the work has ended.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
T = TypeVar("T")


async def whole(work: Awaitable[T]) -> T:
    """Await `work` to its end even if the caller is cancelled meanwhile (any number of
    times); the cancellation is raised afterwards, the work's own error first."""
    task = asyncio.ensure_future(work)
    cancelled = False
    while not task.done():
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            cancelled = True
    result = task.result()
    if cancelled:
        raise asyncio.CancelledError
    return result


async def thread_whole(fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    """`asyncio.to_thread` that returns (or raises a cancel) only once the thread is done."""
    return await whole(asyncio.to_thread(fn, *args, **kwargs))
