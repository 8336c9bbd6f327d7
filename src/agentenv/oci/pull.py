"""Pulling an image into the cache: manifest, config, layers, and optionally block layers.

`pull(cache, ref)` resolves the reference (index → linux/amd64), downloads the config and
every layer (concurrently, at most `RegistryConfig.max_downloads` at once, each blob once even
when several pulls want it), checks the config is for linux/amd64 and names as many layers as
the manifest has, and writes ``oci/images/<manifest hex>.json``. While it runs, everything it
has fetched is pinned by a ``pull:<pid>:<n>`` holder, so a concurrent `ImageCache.collect`
cannot take a layer between its download and its use. With ``blocks=True`` the chain block
layers are built too (`agentenv.oci.blocks`) and `PulledImage.layers` holds their layer store
digests bottom→top, which is what a `Template` records. `layer_progress` gets per-layer
download and conversion reports (`agentenv.oci.progress`), throttled.
"""

from __future__ import annotations

import asyncio
import json
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from agentenv.oci import manifest as mf
from agentenv.oci.blocks import ChainBuilder, ChainLayer, chain_ids
from agentenv.oci.cache import ImageCache
from agentenv.oci.client import ProgressFn, RegistryClient, RegistryConfig, Resolved
from agentenv.oci.config import ImageConfig, parse_config
from agentenv.oci.errors import DigestMismatch, OciError, PlatformNotFound
from agentenv.oci.progress import DOWNLOAD, LayerProgress, LayerProgressFn, Throttle
from agentenv.oci.reference import Reference, parse
from agentenv.template.progress import ProgressFn as StepFn


@dataclass(frozen=True)
class PulledImage:
    reference: Reference  # pinned to the manifest digest
    manifest_digest: str
    index_digest: str | None
    config_digest: str
    config: ImageConfig
    layer_blobs: tuple[str, ...]  # compressed layer digests, bottom first
    chain_ids: tuple[str, ...]
    chains: tuple[ChainLayer, ...] = ()
    pull_s: float = 0.0
    block_s: float = 0.0
    downloaded_bytes: int = 0
    blob_paths: tuple[Path, ...] = field(default=(), compare=False)

    @property
    def layers(self) -> list[str]:
        """Layer store digests of the block layers, bottom first (empty without blocks)."""
        return [c.layer for c in self.chains]


def _store_small_blob(cache: ImageCache, digest: str, body: bytes) -> None:
    path = cache.blob_path(digest)
    if not path.is_file():
        fd, name = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(body)
            os.chmod(name, 0o444)
            os.replace(name, path)
        except OSError:
            os.unlink(name)
            raise
    cache.record(f"blob:{digest}", "blob", len(body))


async def pull(
    cache: ImageCache,
    ref: Reference | str,
    *,
    config: RegistryConfig | None = None,
    client: RegistryClient | None = None,
    blocks: bool = False,
    platform: mf.Platform = mf.LINUX_AMD64,
    progress: ProgressFn | None = None,
    steps: StepFn | None = None,
    layer_progress: LayerProgressFn | None = None,
) -> PulledImage:
    reference = parse(ref) if isinstance(ref, str) else ref
    own = client is None
    rc = client or RegistryClient(config or RegistryConfig.from_env(), cache)
    if rc.cache is None:
        rc.cache = cache
    holder = cache.new_pull_holder()
    started = time.monotonic()
    before = rc.stats.bytes_downloaded
    try:
        resolved = await rc.resolve(reference, platform)
        await asyncio.to_thread(_keep_manifests, cache, resolved, holder)
        man = resolved.manifest
        await asyncio.to_thread(
            cache.pin, holder, [f"blob:{d.digest}" for d in (man.config, *man.layers)]
        )
        config_path = await rc.fetch_blob(resolved.reference, man.config)
        image_config = parse_config(await asyncio.to_thread(config_path.read_bytes))
        got = image_config.platform
        if (got.os, got.architecture) != (platform.os, platform.architecture):
            raise PlatformNotFound(f"{reference}: the image is for {got}, not {platform}")
        if len(image_config.diff_ids) != len(man.layers):
            raise DigestMismatch(
                f"{reference}: the config lists {len(image_config.diff_ids)} layers, "
                f"the manifest {len(man.layers)}"
            )
        if not man.layers:
            raise OciError(f"{reference}: the image has no layers")
        throttle = Throttle(layer_progress)
        count = len(man.layers)

        async def fetch(i: int, desc: mf.Descriptor) -> Path:
            fetched = False

            def on_bytes(digest: str, done: int, total: int) -> None:
                nonlocal fetched
                fetched = True
                if progress is not None:
                    progress(digest, done, total)
                throttle(LayerProgress(DOWNLOAD, i, count, desc.digest, done, total))

            path = await rc.fetch_blob(resolved.reference, desc, on_bytes)
            if not fetched:  # in the cache already
                size = desc.size
                throttle(LayerProgress(DOWNLOAD, i, count, desc.digest, size, size, cached=True))
            return path

        # A task group, not gather: when one layer fails, the downloads of the others are
        # cancelled and waited for before the client closes (each drops its partial file).
        try:
            async with asyncio.TaskGroup() as tg:
                fetches = [tg.create_task(fetch(i, d)) for i, d in enumerate(man.layers)]
        except BaseExceptionGroup as group:
            raise group.exceptions[0] from None  # the first failure, as gather would
        paths = [f.result() for f in fetches]
        ids = chain_ids(image_config.diff_ids)
        pull_s = time.monotonic() - started
        chains: list[ChainLayer] = []
        block_s = 0.0
        if blocks:
            t0 = time.monotonic()
            chains = await ChainBuilder(cache).ensure(
                list(zip(paths, image_config.diff_ids, strict=True)), steps, throttle
            )
            block_s = time.monotonic() - t0
        record = {
            "reference": str(resolved.reference),
            "manifest": resolved.manifest_digest,
            "index": resolved.index_digest,
            "config": man.config.digest,
            "layers": [d.digest for d in man.layers],
            "chains": ids,
            "pulled_at": time.time(),
        }
        await asyncio.to_thread(
            _write_atomic, cache.image_record(resolved.manifest_digest), json.dumps(record)
        )
        return PulledImage(
            reference=resolved.reference,
            manifest_digest=resolved.manifest_digest,
            index_digest=resolved.index_digest,
            config_digest=man.config.digest,
            config=image_config,
            layer_blobs=tuple(d.digest for d in man.layers),
            chain_ids=tuple(ids),
            chains=tuple(chains),
            pull_s=round(pull_s, 3),
            block_s=round(block_s, 3),
            downloaded_bytes=rc.stats.bytes_downloaded - before,
            blob_paths=tuple(paths),
        )
    finally:
        await asyncio.to_thread(cache.unpin, holder)
        if own:
            await rc.close()


def _write_atomic(path: Path, text: str) -> None:
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
        os.replace(name, path)
    except OSError:
        os.unlink(name)
        raise


def _keep_manifests(cache: ImageCache, resolved: Resolved, holder: str) -> None:
    cache.ensure_dirs()
    _store_small_blob(cache, resolved.manifest_digest, resolved.manifest_bytes)
    keys = [f"blob:{resolved.manifest_digest}"]
    if resolved.index_digest and resolved.index_bytes is not None:
        _store_small_blob(cache, resolved.index_digest, resolved.index_bytes)
        keys.append(f"blob:{resolved.index_digest}")
    cache.pin(holder, keys)
