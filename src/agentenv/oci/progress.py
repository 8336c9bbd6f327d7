"""Per-layer progress of a pull: bytes downloaded, then bytes converted into block layers.

`pull(..., layer_progress=fn)` calls ``fn(LayerProgress(...))`` as each layer's download and
conversion advance. Calls are throttled at the source (`Throttle`: at most a few per second
per layer and phase, plus the final one), and conversion calls come from a worker thread, so
a receiver must be thread-safe and quick (the build server stores the latest value per layer).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

DOWNLOAD = "download"
CONVERT = "convert"
# Seconds between two reports of one layer and phase (the last one is always reported).
MIN_INTERVAL_S = 0.25


@dataclass(frozen=True)
class LayerProgress:
    phase: str  # DOWNLOAD or CONVERT
    index: int  # the layer's position in the image, 0 = bottom
    count: int  # layers in the image
    digest: str  # the compressed layer's digest (the manifest's)
    done: int  # bytes: compressed ones downloaded, or uncompressed ones applied
    total: int
    cached: bool = False  # already in the cache: nothing was done


LayerProgressFn = Callable[[LayerProgress], None]


class Throttle:
    """Forwards a report when `MIN_INTERVAL_S` has passed since the last one of its layer and
    phase, or when it completes the layer; drops the others."""

    def __init__(
        self,
        fn: LayerProgressFn | None,
        interval_s: float = MIN_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.fn = fn
        self.interval_s = interval_s
        self.clock = clock
        self._last: dict[tuple[str, int], float] = {}
        self._lock = threading.Lock()

    def __call__(self, p: LayerProgress) -> None:
        if self.fn is None:
            return
        key = (p.phase, p.index)
        now = self.clock()
        with self._lock:
            last = self._last.get(key)
            final = p.done >= p.total
            if not final and last is not None and now - last < self.interval_s:
                return
            self._last[key] = now
        self.fn(p)
