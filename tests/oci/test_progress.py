"""Per-layer progress of a pull: download and conversion reports, throttled, cached ones."""

from __future__ import annotations

import gzip
from pathlib import Path

import zstandard

from agentenv.oci.cache import ImageCache
from agentenv.oci.progress import CONVERT, DOWNLOAD, LayerProgress, Throttle
from agentenv.oci.pull import pull
from agentenv.storage.layers import LayerStore

from .conftest import Images, Registries


def _report(done: int, total: int = 100, index: int = 0) -> LayerProgress:
    return LayerProgress(DOWNLOAD, index, 2, "sha256:" + "a" * 64, done, total)


def test_throttle_drops_reports_between_intervals_but_never_the_last() -> None:
    got: list[LayerProgress] = []
    clock = [100.0]
    t = Throttle(got.append, interval_s=0.25, clock=lambda: clock[0])
    t(_report(10))
    t(_report(20))  # same instant: dropped
    t(_report(5, index=1))  # another layer has its own clock
    clock[0] += 0.3
    t(_report(30))
    t(_report(100))  # complete: always forwarded
    assert [(p.index, p.done) for p in got] == [(0, 10), (1, 5), (0, 30), (0, 100)]
    Throttle(None)(_report(1))  # no receiver: nothing to do


def _uncompressed(data: bytes) -> int:
    if data[:2] == b"\x1f\x8b":
        return len(gzip.decompress(data))
    if data[:4] == b"\x28\xb5\x2f\xfd":
        return len(zstandard.ZstdDecompressor().decompressobj().decompress(data))
    return len(data)


async def test_pull_reports_every_layer_downloaded_then_converted(
    registries: Registries, images: Images, tmp_path: Path
) -> None:
    cache = ImageCache(tmp_path / "oci", LayerStore(tmp_path / "layers"))
    ref = f"{registries.open.host}/{images.app.repo}:{images.app.tag}"
    seen: list[LayerProgress] = []
    await pull(cache, ref, blocks=True, layer_progress=seen.append)
    n = len(images.app.layer_digests)
    for i, digest in enumerate(images.app.layer_digests):
        mine = [p for p in seen if p.index == i]
        assert {p.digest for p in mine} == {digest}
        assert all(p.count == n and p.done <= p.total for p in mine)
        down = [p for p in mine if p.phase == DOWNLOAD]
        conv = [p for p in mine if p.phase == CONVERT]
        size = len(images.app.layer_bytes[i])
        assert down[-1].done == down[-1].total == size and not down[-1].cached
        assert conv[-1].done == conv[-1].total == _uncompressed(images.app.layer_bytes[i])
        # Conversion of a layer starts once its blob is complete.
        assert seen.index(conv[0]) > seen.index(down[-1])
    again: list[LayerProgress] = []
    await pull(cache, ref, blocks=True, layer_progress=again.append)
    assert len(again) == 2 * n
    assert all(p.cached and p.done == p.total for p in again)
