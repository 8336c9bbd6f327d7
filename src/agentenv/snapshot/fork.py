"""Fork: one capture of a running sandbox (or of a paused one's files, `fork_paused`), N
children restored from it, each with its own identity (id, hostname, reseeded RNG, clock). A
running source is stopped only for the capture; a paused one stays paused, untouched."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from agentenv.cleanup import Cleanup, CleanupFailed
from agentenv.faults import crash_point
from agentenv.guest.envd.client import EnvdClient
from agentenv.network import Slot
from agentenv.snapshot.capture import Capture, capture
from agentenv.snapshot.identity import identify
from agentenv.snapshot.machine import GuestImage, Machine, envd_url
from agentenv.snapshot.paused_capture import capture_paused
from agentenv.snapshot.repository import SnapshotStore
from agentenv.snapshot.restore import release, restore
from agentenv.storage import LayerStore

log = logging.getLogger(__name__)

MAX_CHILDREN = 100
# Restores are mostly QEMU spawn and page faults; a few at once keep two cores busy.
RESTORE_CONCURRENCY = 4
CLAIM = "claim"


@dataclass(frozen=True)
class ForkTarget:
    name: str
    workdir: Path
    slot: Slot
    # The child's own envd token (None: the source's is cleared) and env vars, set in the
    # same `/init` that gives it its hostname.
    access_token: str | None = None
    env_vars: Mapping[str, str] | None = None


@dataclass(frozen=True)
class ForkResult:
    capture: Capture
    children: list[Machine]
    total_s: float


async def fork(
    source: Machine,
    targets: Sequence[ForkTarget | Awaitable[ForkTarget]],
    repo: SnapshotStore,
    layers: LayerStore,
    image: GuestImage,
    *,
    env_vars: Mapping[str, str] | None = None,
    concurrency: int = RESTORE_CONCURRENCY,
    envd_token: str | None = None,
) -> ForkResult:
    """All children or none: a failure (or a cancellation) of any child cancels the others
    and releases the children already started; the caller releases the targets (workdirs,
    slots). The capture is an unnamed snapshot held by the children; `repo.gc()` drops it
    after the last one.

    Up to `concurrency` children are restored at once; `children` is in target order. A
    target may be an awaitable (e.g. a future the caller resolves while it sets up the next
    one) so that setting up targets overlaps the capture and the first restores; the caller
    owns what it made for those, also when fork fails before awaiting them."""
    _check_counts(targets, concurrency)
    t0 = time.monotonic()
    claim = _claim(source.name, t0)
    cap = await capture(
        source,
        repo,
        layers,
        image,
        keep_running=True,
        source=source.name,
        holders=[claim],
        envd_token=envd_token,
    )
    crash_point("fork:captured")
    children = await _children(
        cap, claim, targets, repo, layers, image, env_vars, concurrency, envd_token
    )
    return ForkResult(cap, children, time.monotonic() - t0)


async def fork_paused(
    workdir: Path,
    targets: Sequence[ForkTarget | Awaitable[ForkTarget]],
    repo: SnapshotStore,
    layers: LayerStore,
    image: GuestImage,
    *,
    env_vars: Mapping[str, str] | None = None,
    concurrency: int = RESTORE_CONCURRENCY,
    envd_token: str | None = None,
) -> ForkResult:
    """`fork` of the sandbox paused in `workdir`, which stays paused as it was: the capture
    is a snapshot of its files (`paused_capture.capture_paused`), the rest as `fork`.
    `envd_token` is the token the paused guest's envd holds."""
    _check_counts(targets, concurrency)
    t0 = time.monotonic()
    claim = _claim(workdir.name, t0)
    cap = await capture_paused(workdir, repo, layers, image, holders=[claim], envd_token=envd_token)
    crash_point("fork:captured")
    children = await _children(
        cap, claim, targets, repo, layers, image, env_vars, concurrency, envd_token
    )
    return ForkResult(cap, children, time.monotonic() - t0)


def _claim(source: str, t0: float) -> str:
    """The fork's own hold on its capture until every child holds it. No ":" in it: a node
    that starts releases holders without one that name no sandbox directory
    (`Node._release_orphan_holders`), so a crash mid-fork does not keep the capture (for a
    paused source, a copy of its memory) for ever."""
    return f"fork-{source}-{t0:.6f}"


def _check_counts(targets: Sequence[object], concurrency: int) -> None:
    if not 1 <= len(targets) <= MAX_CHILDREN:
        raise ValueError(f"fork count must be between 1 and {MAX_CHILDREN}, got {len(targets)}")
    if concurrency < 1:
        raise ValueError(f"fork concurrency must be at least 1, got {concurrency}")


async def _children(
    cap: Capture,
    claim: str,
    targets: Sequence[ForkTarget | Awaitable[ForkTarget]],
    repo: SnapshotStore,
    layers: LayerStore,
    image: GuestImage,
    env_vars: Mapping[str, str] | None,
    concurrency: int,
    envd_token: str | None,
) -> list[Machine]:
    """The children restored from `cap`, which `claim` holds (released here, also when this
    fails)."""
    # The fork's own stack: the claim on the capture, then each child restored (released
    # if the fork fails; the caller owns the targets' workdirs and slots).
    stack = Cleanup(f"fork from {cap.snapshot.id[:12]}")
    stack.push(CLAIM, lambda: asyncio.to_thread(repo.unref, cap.snapshot.id, claim))
    sem = asyncio.Semaphore(concurrency)
    made: dict[int, Machine] = {}

    async def one(i: int, target: ForkTarget | Awaitable[ForkTarget]) -> None:
        # Shielded: cancelling this child must not cancel the caller's future.
        t = target if isinstance(target, ForkTarget) else await asyncio.shield(target)
        async with sem, EnvdClient(envd_url(t.slot), envd_token) as envd:
            child = made[i] = await restore(
                repo, layers, image, cap.snapshot.id,
                name=t.name, workdir=t.workdir, slot=t.slot, envd=envd,
            )  # fmt: skip
            stack.push(f"child {t.name}", lambda: release(child, repo, layers))
            crash_point("fork:child")
            env = {**(env_vars or {}), **(t.env_vars or {})}
            await identify(
                envd,
                hostname=t.name,
                env_vars=env or None,
                access_token=t.access_token or ("" if envd_token else None),
            )

    try:
        try:
            async with asyncio.TaskGroup() as tg:
                for i, target in enumerate(targets):
                    tg.create_task(one(i, target), name=f"fork-{cap.snapshot.id[:12]}-{i}")
        except BaseExceptionGroup as group:
            # Callers map single errors (RestoreFailed, ...) to their own; give them the first.
            raise _first(group) from None
        # Whole: a cancel arriving here still releases the children (below).
        await stack.release(CLAIM)
    except BaseException:
        with contextlib.suppress(CleanupFailed):
            await stack.run()
        raise
    return [made[i] for i in range(len(targets))]


def _first(group: BaseExceptionGroup[BaseException]) -> BaseException:
    for exc in group.exceptions:
        return _first(exc) if isinstance(exc, BaseExceptionGroup) else exc
    return group
