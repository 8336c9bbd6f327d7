"""The image cache's size cap: least recently used first, pinned and in-use entries kept."""

from __future__ import annotations

import os
import subprocess
import time

from agentenv.oci.cache import ImageCache
from agentenv.oci.pull import pull

from .conftest import Images, Registries


def _fake_blob(cache: ImageCache, n: int, size: int) -> str:
    digest = "sha256:" + f"{n:064x}"
    cache.ensure_dirs()
    cache.blob_path(digest).write_bytes(b"\0" * size)
    cache.record(f"blob:{digest}", "blob", size)
    time.sleep(0.01)  # distinct last-use times
    return digest


def test_lru_cap_keeps_pinned(cache: ImageCache) -> None:
    d = [_fake_blob(cache, i, 1000) for i in range(5)]
    cache.pin("template:t", [f"blob:{d[0]}"])
    cache.touch([f"blob:{d[1]}"])  # used again: now the most recent
    removed = cache.collect(2500)
    # Oldest first, skipping the pinned one: d2, d3 go, then total 3000 > 2500 so d4 too.
    assert removed == [f"blob:{d[2]}", f"blob:{d[3]}", f"blob:{d[4]}"]
    assert cache.has_blob(d[0]) and cache.has_blob(d[1])
    assert cache.total_bytes() == 2000
    # A cap below what is pinned removes the rest but never the pinned entry.
    assert cache.collect(0) == [f"blob:{d[1]}"]
    assert cache.has_blob(d[0])
    cache.unpin("template:t")
    assert cache.collect(0) == [f"blob:{d[0]}"]


def test_pins_of_a_dead_pull_are_dropped(cache: ImageCache) -> None:
    d = _fake_blob(cache, 1, 100)
    proc = subprocess.Popen(["true"])
    proc.wait()
    cache.pin(f"pull:{proc.pid}:0", [f"blob:{d}"])
    mine = cache.new_pull_holder()
    assert mine.startswith(f"pull:{os.getpid()}:")
    cache.pin(mine, [f"blob:{d}"])  # this process: alive
    assert cache.collect(0) == []
    assert cache.pins(f"blob:{d}") == [mine]  # the dead pull's pin went
    cache.unpin(mine)
    assert cache.collect(0) == [f"blob:{d}"]


async def test_chain_layers_in_use_are_never_collected(
    registries: Registries, images: Images, cache: ImageCache
) -> None:
    app = await pull(cache, f"{registries.open.host}/app:1", blocks=True)
    other = await pull(cache, f"{registries.open.host}/other:1", blocks=True)
    store = cache.layers
    # A template holds app's top block layer in the layer store (as the catalog does), and
    # a sandbox holds other's; their images are not pinned in the cache.
    store.ref(app.layers[-1], "template:app")
    store.ref(other.layers[-1], "sandbox-1")
    removed = cache.collect(0)
    assert all(k.startswith("blob:") for k in removed)
    assert set(store.digests()) == set(app.layers) | set(other.layers)
    # The sandbox ends: other's top layer goes, the shared ones stay under app's template.
    store.unref(other.layers[-1], "sandbox-1")
    removed = cache.collect(0)
    assert removed == [f"chain:{other.chain_ids[-1]}"]
    assert set(store.digests()) == set(app.layers)
    # A pinned image keeps its blobs too.
    again = await pull(cache, f"{registries.open.host}/app:1")
    cache.pin_image("template:app", again.manifest_digest)
    cache.collect(0)
    assert all(cache.has_blob(b) for b in again.layer_blobs)
    store.unref(app.layers[-1], "template:app")
    cache.unpin("template:app")
    cache.collect(0)
    assert store.digests() == [] and cache.total_bytes() == 0
