"""What a build's image pull has done so far, per layer: the latest download and conversion
report of each (`agentenv.oci.progress`), for `GET /templates/{id}/builds/{build}/progress`
(not an E2B route: the status route's log entries keep E2B's shape, and the SDK drops any
field it does not know). The log gets one line per layer and phase when it completes.

Reports arrive from the event loop (downloads) and from worker threads (conversion), so the
state is behind a lock and the log lines are handed to the loop.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

from agentenv.oci.progress import DOWNLOAD, LayerProgress, LayerProgressFn

MB = 1_000_000
_PHASE_ORDER = {DOWNLOAD: 0}


class BuildProgress:
    def __init__(self, image: str) -> None:
        self.image = image
        self._lock = threading.Lock()
        self._latest: dict[tuple[int, str], LayerProgress] = {}

    def update(self, p: LayerProgress) -> bool:
        """Record `p`; True when it is the first report that completes its layer and phase."""
        with self._lock:
            before = self._latest.get((p.index, p.phase))
            self._latest[(p.index, p.phase)] = p
        return p.done >= p.total and (before is None or before.done < before.total)

    def wire(self) -> list[dict[str, Any]]:
        with self._lock:
            rows = sorted(
                self._latest.values(), key=lambda p: (p.index, _PHASE_ORDER.get(p.phase, 1))
            )
        return [
            {
                "phase": p.phase,
                "layer": p.index + 1,
                "layers": p.count,
                "digest": p.digest,
                "done": p.done,
                "total": p.total,
                "cached": p.cached,
            }
            for p in rows
        ]


def size(n: int) -> str:
    """Bytes for people, in decimal units as registries and `docker pull` show them."""
    if n < 1000:
        return f"{n} B"
    if n < MB:
        return f"{n / 1000:.1f} kB"
    return f"{n / MB:.1f} MB"


def milestone(p: LayerProgress) -> str:
    """The log line of a completed layer and phase."""
    where = f"layer {p.index + 1}/{p.count} ({p.digest[7:19]})"
    if p.cached:
        return f"{where}: {'in the cache' if p.phase == DOWNLOAD else 'block layer cached'}"
    if p.phase == DOWNLOAD:
        return f"{where}: downloaded {size(p.total)}"
    return f"{where}: block layer written ({size(p.total)} of content)"


def receiver(
    progress: BuildProgress, loop: asyncio.AbstractEventLoop, log: Callable[[str], None]
) -> LayerProgressFn:
    """The `layer_progress` callback of a pull: records into `progress`; `log(line)` is
    called on `loop` for each completed layer and phase."""

    def on_progress(p: LayerProgress) -> None:
        if progress.update(p):
            loop.call_soon_threadsafe(log, milestone(p))

    return on_progress
