"""Rich progress display for long host-side work (setup, kernel builds)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Protocol

from rich.console import Console
from rich.progress import (
    BarColumn,
    Progress,
    SpinnerColumn,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)


class ProgressFn(Protocol):
    def __call__(self, step: str, done: int | None = None, total: int | None = None) -> None: ...


@contextmanager
def step_progress(console: Console) -> Iterator[ProgressFn]:
    """Yield a callback that shows one line per step, with a bar when the step has a total."""
    progress = Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.percentage:>3.0f}%"),
        TimeElapsedColumn(),
        console=console,
        transient=False,
    )
    tasks: dict[str, TaskID] = {}
    current: list[str] = []

    def finish(task: TaskID) -> None:
        total = progress.tasks[task].total or 1
        progress.update(task, total=total, completed=total)

    def report(step: str, done: int | None = None, total: int | None = None) -> None:
        # A new step finishes the previous one, so every line ends as done.
        if current and current[-1] != step:
            finish(tasks[current[-1]])
        if step not in tasks:
            tasks[step] = progress.add_task(step, total=total or None)
            current.append(step)
        progress.update(tasks[step], completed=done or 0, total=total or None)

    with progress:
        yield report
        if current:
            finish(tasks[current[-1]])
