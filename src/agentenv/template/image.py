"""Templates from container images: pull, add the agentenv top layer, register.

`import_image(settings, ref, name=...)` pulls `ref` with `agentenv.oci.pull` (block layers keyed
by OCI chain id, so images that share base layers share them), puts one more block layer on
top (`template.imagetree`: /.agentenv, hosts, hostname, a shell, the ``user`` account) and
registers the catalog `Template` ``name``: the image's block layers plus that top layer, with
the image config's Env, WorkingDir, User, Entrypoint/Cmd and ExposedPorts recorded on it. The
node applies env, workdir and user to every sandbox of the template through envd ``/init``.

* **The top layer** is keyed like a chain layer: ``sha256(<image chain id> " agentenv-top:"
  <recipe>)``, where the recipe is the content of `imagetree`. So importing the same image
  again (under any name) reuses every block layer, and a new agentenv rebuilds only the top.
  It is built like `oci.blocks` builds upper layers: an empty qcow2 overlay on the image's
  top, exported raw by qemu-storage-daemon through FUSE, loop-mounted, edited, unmounted; it
  holds only the clusters the edit changed. It is recorded as a chain (`oci/chains`), held in
  the layer store as ``oci-chain:<id>``, so `ImageCache.collect` treats it like the others.
* **Idempotent**: the template is replaced (the catalog's `put`), its layer reference moved
  to the new top and its image pins to the new image. Its template snapshots are keyed by its
  layers (`snapshot.templates.build_key`), so a changed image gets a new snapshot and an
  unchanged one keeps its snapshot.
* **Concurrent imports** of one reference in this process share one pull; across processes a
  per-reference file lock makes the later one wait, then find every blob and layer cached.
* **Pins**: the template (holder ``template:<name>``) holds its top layer in the layer store,
  which protects the whole chain below, and pins the image's blobs in the image cache, so a
  rebuild does not download again.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

from agentenv.config import Settings
from agentenv.filelock import file_lock
from agentenv.oci.auth import Credentials
from agentenv.oci.blocks import (
    ChainBuilder,
    ChainLayer,
    _fuse_export,
    _loop_mounted,
    _run,
    _stored_bytes,
    _used_bytes,
    with_space_hint,
)
from agentenv.oci.cache import CHAIN_HOLDER, ImageCache
from agentenv.oci.client import RegistryConfig
from agentenv.oci.config import ImageConfig
from agentenv.oci.progress import LayerProgressFn
from agentenv.oci.pull import PulledImage, pull
from agentenv.oci.reference import Reference, parse
from agentenv.template import imagetree
from agentenv.template.cache import digest_files
from agentenv.template.catalog import Template, TemplateCatalog, validate_name
from agentenv.template.errors import TemplateNotFound
from agentenv.template.imagetree import TreeFacts

LogFn = Callable[[str], None]
HOLDER = "template:"
TOP_TAG = "agentenv-top"
PULL_LOCK_TIMEOUT_S = 3600.0
TOP_LOCK_TIMEOUT_S = 600.0

# Pulls under way in this process, by (loop, data dir, reference, user): concurrent imports of one
# image wait for the same pull.
_pulls: dict[tuple[int, str, str, str], asyncio.Task[PulledImage]] = {}


def recipe_digest() -> str:
    """What the top layer is made by: the tree configuration's source."""
    return digest_files(Path(imagetree.__file__))


def top_chain_id(image_chain: str) -> str:
    seed = f"{image_chain} {TOP_TAG}:{recipe_digest()}"
    return "sha256:" + hashlib.sha256(seed.encode()).hexdigest()


def _quiet(_: str) -> None:
    pass


async def import_image(
    settings: Settings,
    ref: str,
    *,
    name: str,
    credentials: tuple[str, str] | None = None,
    log: LogFn | None = None,
    layer_progress: LayerProgressFn | None = None,
) -> Template:
    """Pull `ref` and register it as template `name` (replacing one of that name).
    `layer_progress` gets the pull's per-layer reports (only the import that starts a pull:
    one that joins a pull under way sees its log lines, not its bytes)."""
    validate_name(name)
    say = log or _quiet
    reference = parse(ref)
    cache = ImageCache.for_settings(settings)
    t0 = time.monotonic()
    pulled = await _pull_once(settings, cache, reference, credentials, say, layer_progress)
    say(
        f"pulled {pulled.reference} ({len(pulled.layer_blobs)} layers, "
        f"{pulled.downloaded_bytes} bytes downloaded, {pulled.pull_s:.2f}s, "
        f"block layers {pulled.block_s:.2f}s)"
    )
    top, facts = await _ensure_top(cache, pulled, say)
    for note in facts.notes:
        say(note)
    template = await asyncio.to_thread(_register, settings, cache, name, pulled, top, facts)
    say(
        f"template {name}: {len(template.layers)} layers, {template.size_mb} MB, "
        f"imported in {time.monotonic() - t0:.2f}s"
    )
    return template


async def _pull_once(
    settings: Settings,
    cache: ImageCache,
    reference: Reference,
    credentials: tuple[str, str] | None,
    say: LogFn,
    layer_progress: LayerProgressFn | None = None,
) -> PulledImage:
    # Per event loop too: a task of another (closed) loop cannot be awaited here.
    loop = id(asyncio.get_running_loop())
    key = (loop, str(settings.home), str(reference), credentials[0] if credentials else "")
    task = _pulls.get(key)
    if task is None or task.done():
        task = asyncio.ensure_future(_pull(cache, reference, credentials, say, layer_progress))
        _pulls[key] = task
        task.add_done_callback(lambda t: _pulls.pop(key, None) if _pulls.get(key) is t else None)
    else:
        say(f"waiting for the pull of {reference} already under way")
    # Shielded: one caller giving up does not cancel the pull the others wait for.
    return await asyncio.shield(task)


async def _pull(
    cache: ImageCache,
    reference: Reference,
    credentials: tuple[str, str] | None,
    say: LogFn,
    layer_progress: LayerProgressFn | None = None,
) -> PulledImage:
    creds: dict[str, Credentials] = {}
    if credentials is not None:
        c = Credentials(credentials[0], credentials[1])
        # The client asks by API host (Docker Hub's differs from its name); a token realm on
        # another host gets them through the challenge.
        creds = {reference.registry: c, reference.api_host: c}
    config = RegistryConfig.from_env(credentials=creds)

    def steps(step: str, done: int | None = None, total: int | None = None) -> None:
        say(step)

    await asyncio.to_thread(cache.ensure_dirs)
    lock = cache.locks / f"pull-{hashlib.sha256(str(reference).encode()).hexdigest()[:32]}.lock"
    async with file_lock(
        lock,
        name=f"the pull lock of {reference}",
        timeout_s=PULL_LOCK_TIMEOUT_S,
        waiter=f"an import of {reference}",
    ):
        say(f"pulling {reference}")
        return await pull(
            cache,
            reference,
            config=config,
            blocks=True,
            steps=steps,
            layer_progress=layer_progress,
        )


def _facts_path(cache: ImageCache, chain_id: str) -> Path:
    return cache.chains / f"{chain_id.split(':', 1)[1]}.agentenv.json"


def _read_facts(cache: ImageCache, chain_id: str) -> TreeFacts | None:
    try:
        raw = json.loads(_facts_path(cache, chain_id).read_text())
        return TreeFacts(**raw)
    except (FileNotFoundError, ValueError, TypeError):
        return None


async def _ensure_top(
    cache: ImageCache, pulled: PulledImage, say: LogFn
) -> tuple[ChainLayer, TreeFacts]:
    parent = pulled.chains[-1]
    chain_id = top_chain_id(parent.chain_id)
    builder = ChainBuilder(cache)

    def cached() -> tuple[ChainLayer, TreeFacts] | None:
        layer = builder.get(chain_id)
        facts = _read_facts(cache, chain_id)
        return (layer, facts) if layer is not None and facts is not None else None

    found = await asyncio.to_thread(cached)
    if found is None:
        async with file_lock(
            cache.lock_path(chain_id),
            name=f"the top layer build lock of {chain_id}",
            timeout_s=TOP_LOCK_TIMEOUT_S,
            waiter=f"the agentenv layer of {pulled.reference}",
        ):
            found = await asyncio.to_thread(cached)
            if found is None:
                say("adding the agentenv layer")
                found = await asyncio.to_thread(_build_top, cache, parent, chain_id, pulled.config)
    await asyncio.to_thread(cache.touch, [f"chain:{chain_id}"])
    return found


def _build_top(
    cache: ImageCache, parent: ChainLayer, chain_id: str, config: ImageConfig
) -> tuple[ChainLayer, TreeFacts]:
    what = f"the agentenv layer {chain_id}"
    started = time.monotonic()
    tmp = cache.root / "tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    scratch = tmp / f"top-{chain_id.split(':')[1][:16]}-{os.getpid()}"
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir()
    try:
        qcow2 = scratch / "layer.qcow2"
        backing = cache.layers.path(parent.layer)
        _run(
            ["qemu-img", "create", "-q", "-f", "qcow2", "-F", "qcow2",
             "-b", str(backing), str(qcow2), str(parent.virtual_size)],
            what,
        )  # fmt: skip
        mnt = scratch / "mnt"
        export = scratch / "disk.raw"
        with _fuse_export(qcow2, export, what), _loop_mounted(export, mnt, what):
            facts = imagetree.configure_image_tree(mnt, config)
            used = _used_bytes(mnt)
        digest = cache.layers.add(qcow2)
        cache.layers.ref(digest, CHAIN_HOLDER + chain_id)
        layer = ChainLayer(
            chain_id=chain_id,
            diff_id="sha256:" + recipe_digest(),
            parent=parent.chain_id,
            layer=digest,
            virtual_size=parent.virtual_size,
            used_bytes=used,
            stored_bytes=_stored_bytes(cache.layers.path(digest)),
            build_s=round(time.monotonic() - started, 3),
        )
        side = _facts_path(cache, chain_id)
        side.with_suffix(".tmp").write_text(json.dumps(asdict(facts)))
        os.replace(side.with_suffix(".tmp"), side)
        record = cache.chain_record(chain_id)
        record.with_suffix(".tmp").write_text(json.dumps(asdict(layer), indent=1))
        os.replace(record.with_suffix(".tmp"), record)
        cache.record(f"chain:{chain_id}", "chain", layer.stored_bytes)
        return layer, facts
    except Exception as exc:
        named = with_space_hint(exc, [tmp, cache.layers.root])
        if named is not None:
            raise named from exc
        raise
    finally:
        if not any(os.path.ismount(p) for p in (scratch / "mnt", scratch / "disk.raw")):
            shutil.rmtree(scratch, ignore_errors=True)


def _register(
    settings: Settings,
    cache: ImageCache,
    name: str,
    pulled: PulledImage,
    top: ChainLayer,
    facts: TreeFacts,
) -> Template:
    cfg = pulled.config
    layers = [*pulled.layers, top.layer]
    holder = HOLDER + name
    store = cache.layers
    catalog = TemplateCatalog(settings)
    try:
        old: Template | None = catalog.get(name)
    except TemplateNotFound:
        old = None
    workdir = cfg.working_dir if cfg.working_dir not in ("", "/") else None
    template = Template(
        name=name,
        layers=layers,
        size_mb=top.size_mb,
        build_key=top.chain_id.split(":", 1)[1][:32],
        source=str(pulled.reference),
        env=dict(cfg.env),
        workdir=workdir,
        user=facts.user,
        entrypoint=list(cfg.entrypoint),
        cmd=list(cfg.cmd),
        exposed_ports=[f"{port}/{proto}" for port, proto in cfg.exposed_ports],
    )
    # Hold the new layers before the catalog points at them; drop the old ones after.
    store.ref(top.layer, holder)
    cache.unpin(holder)
    cache.pin_image(holder, pulled.manifest_digest)
    cache.pin(holder, [f"chain:{top.chain_id}"])
    catalog.put(template)
    if old is not None:
        for digest in old.layers:
            if digest not in layers:
                store.unref(digest, holder)
    return template


def remove_template(settings: Settings, name: str) -> Template:
    """Delete template `name` from the catalog and drop what it held: its layer reference
    and its image pins. Sandboxes of it keep running: each holds its own top layer, which
    protects the chain below; `ImageCache.collect` may take the rest later."""
    removed = TemplateCatalog(settings).delete(name)
    cache = ImageCache.for_settings(settings)
    cache.layers.unref_holder(HOLDER + name)
    cache.unpin(HOLDER + name)
    return removed
