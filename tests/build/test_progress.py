"""A build's pull progress: the latest report per layer and phase, milestones once."""

from __future__ import annotations

import asyncio

from agentenv.build.progress import BuildProgress, milestone, receiver
from agentenv.oci.progress import CONVERT, DOWNLOAD, LayerProgress

DIGEST = "sha256:" + "ab" * 32


def _p(phase: str, index: int, done: int, total: int, cached: bool = False) -> LayerProgress:
    return LayerProgress(phase, index, 2, DIGEST, done, total, cached)


def test_latest_report_per_layer_and_phase_in_layer_order() -> None:
    bp = BuildProgress("reg/app:1")
    assert not bp.update(_p(CONVERT, 1, 5, 10))
    assert not bp.update(_p(DOWNLOAD, 1, 5, 10))
    assert bp.update(_p(DOWNLOAD, 0, 3, 3))  # completes: first time only
    assert not bp.update(_p(DOWNLOAD, 0, 3, 3))
    rows = bp.wire()
    assert [(r["layer"], r["phase"], r["done"]) for r in rows] == [
        (1, DOWNLOAD, 3),
        (2, DOWNLOAD, 5),
        (2, CONVERT, 5),
    ]
    assert rows[0] == {"phase": DOWNLOAD, "layer": 1, "layers": 2, "digest": DIGEST,
                       "done": 3, "total": 3, "cached": False}  # fmt: skip


def test_milestones() -> None:
    assert milestone(_p(DOWNLOAD, 0, 2_500_000, 2_500_000)) == (
        "layer 1/2 (abababababab): downloaded 2.5 MB"
    )
    assert "block layer written (7.0 MB" in milestone(_p(CONVERT, 1, 7_000_000, 7_000_000))
    assert milestone(_p(DOWNLOAD, 1, 192, 192)).endswith("downloaded 192 B")
    assert milestone(_p(CONVERT, 1, 10_240, 10_240)).endswith("(10.2 kB of content)")
    assert milestone(_p(CONVERT, 1, 1, 1, cached=True)).endswith("block layer cached")


async def test_receiver_logs_on_the_loop_once_per_completion() -> None:
    bp = BuildProgress("x")
    lines: list[str] = []
    fn = receiver(bp, asyncio.get_running_loop(), lines.append)
    # Conversion reports come from worker threads.
    await asyncio.to_thread(fn, _p(CONVERT, 0, 1, 2))
    await asyncio.to_thread(fn, _p(CONVERT, 0, 2, 2))
    await asyncio.to_thread(fn, _p(CONVERT, 0, 2, 2))
    await asyncio.sleep(0)
    assert len(lines) == 1 and "block layer written" in lines[0]
