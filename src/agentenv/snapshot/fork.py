"""Fork: one capture of a running sandbox, N children restored from it, each with its own
identity (id, hostname, reseeded RNG, clock). The source is stopped only for the capture."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from agentenv.network import Slot
from agentenv.snapshot.capture import Capture, capture
from agentenv.snapshot.identity import identify
from agentenv.snapshot.machine import GuestImage, Machine
from agentenv.snapshot.repository import SnapshotStore
from agentenv.snapshot.restore import release, restore
from agentenv.storage import LayerStore

MAX_CHILDREN = 100
# Restores are mostly QEMU spawn and page faults; a few at once keep two cores busy.
RESTORE_CONCURRENCY = 4


@dataclass(frozen=True)
class ForkTarget:
    name: str
    workdir: Path
    slot: Slot


@dataclass(frozen=True)
class ForkResult:
    capture: Capture
    children: list[Machine]
    total_s: float


async def fork(
    source: Machine,
    targets: Sequence[ForkTarget],
    repo: SnapshotStore,
    layers: LayerStore,
    image: GuestImage,
    *,
    env_vars: Mapping[str, str] | None = None,
    concurrency: int = RESTORE_CONCURRENCY,
    envd_token: str | None = None,
) -> ForkResult:
    """All children or none: a failure releases the children already started. The capture
    is an unnamed snapshot held by the children; `repo.gc()` drops it after the last one."""
    if not 1 <= len(targets) <= MAX_CHILDREN:
        raise ValueError(f"fork count must be between 1 and {MAX_CHILDREN}, got {len(targets)}")
    t0 = time.monotonic()
    claim = f"fork:{source.name}:{t0}"
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
    sem = asyncio.Semaphore(concurrency)
    children: list[Machine] = []

    async def one(t: ForkTarget) -> None:
        async with sem:
            child = await restore(
                repo, layers, image, cap.snapshot.id, name=t.name, workdir=t.workdir, slot=t.slot
            )
            children.append(child)
            await identify(
                child.envd_url,
                hostname=t.name,
                env_vars=env_vars,
                current_token=envd_token,
                access_token="" if envd_token else None,
            )

    try:
        results = await asyncio.gather(*(one(t) for t in targets), return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException):
                raise r
    except BaseException:
        for child in children:
            with contextlib.suppress(Exception):
                await release(child, repo, layers)
        raise
    finally:
        await asyncio.to_thread(repo.unref, cap.snapshot.id, claim)
    return ForkResult(cap, children, time.monotonic() - t0)
