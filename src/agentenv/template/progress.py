"""The progress callback every long-running build step reports through."""

from __future__ import annotations

from collections.abc import Callable

# step, done, total: the CLI renders it with rich; None totals mean "indeterminate".
ProgressFn = Callable[[str, int | None, int | None], None]


def report(
    progress: ProgressFn | None, step: str, done: int | None = None, total: int | None = None
) -> None:
    if progress is not None:
        progress(step, done, total)
