"""`template.image.import_image` against a real registry on loopback: the template it
registers, idempotence, one pull for concurrent imports, registry credentials. No VM (the
sandboxes are in tests/e2e/test_image_templates.py)."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
from oci.images import Pushed, Pusher
from oci.registry import REGISTRY_BIN, Registry

from agentenv.config import Settings
from agentenv.oci.blocks import ChainBuilder
from agentenv.oci.cache import ImageCache
from agentenv.oci.errors import Unauthorized
from agentenv.storage.layers import LayerStore
from agentenv.template.catalog import TemplateCatalog
from agentenv.template.errors import TemplateNotFound
from agentenv.template.image import import_image, remove_template, top_chain_id

from .imagebuild import BUSYBOX_ENV, push_busybox

USER = "bob"
PASSWORD = "pw-for-bob"


@dataclass
class Served:
    open: Registry
    basic: Registry
    busybox: Pushed


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    if not Path(REGISTRY_BIN).exists() or not shutil.which("htpasswd"):
        pytest.fail("docker-registry and apache2-utils are needed: scripts/test installs them")
    root = tmp_path_factory.mktemp("image-registry")
    storage = root / "storage"
    started: list[Registry] = []
    try:
        started.append(Registry.start(root / "open", storage))
        started.append(Registry.start_basic(root / "basic", storage, USER, PASSWORD))
        pusher = Pusher(started[0].url)
        try:
            busybox = push_busybox(pusher)
        finally:
            pusher.close()
        yield Served(started[0], started[1], busybox)
    finally:
        for reg in started:
            reg.stop()


@pytest.fixture
def settings(settings: Settings, tmp_path: Path) -> Settings:
    return replace(settings, home=tmp_path / "home")


async def test_import_registers_layers_defaults_and_reimport_reuses(
    settings: Settings, served: Served
) -> None:
    ref = f"{served.open.host}/busybox:1"
    logs: list[str] = []
    tpl = await import_image(settings, ref, name="bb", log=logs.append)
    cache = ImageCache.for_settings(settings)
    chains = [ChainBuilder(cache).get(c) for c in cache_chain_ids(cache, served.busybox)]
    assert all(chains)
    top = ChainBuilder(cache).get(top_chain_id(chains[-1].chain_id))  # type: ignore[union-attr]
    assert top is not None
    # The image's two block layers, then the agentenv layer over them.
    assert tpl.layers == [c.layer for c in chains if c] + [top.layer]
    store = LayerStore(settings.layers_dir)
    assert store.parent(top.layer) == tpl.layers[1]
    assert "template:bb" in store.holders(top.layer)
    assert tpl.env == BUSYBOX_ENV and tpl.workdir == "/app" and tpl.user == "user"
    assert tpl.cmd == ["sh"] and tpl.entrypoint == [] and tpl.exposed_ports == ["8080/tcp"]
    assert tpl.source == f"{served.open.host}/busybox:1@{served.busybox.manifest_digest}"
    assert TemplateCatalog(settings).get("bb") == tpl
    assert any("agentenv layer" in line for line in logs)
    assert top.stored_bytes < 8 * 1024 * 1024, "the top layer holds only what it changed"
    # The image's blobs are pinned for the template.
    assert "template:bb" in cache.pins(f"blob:{served.busybox.layer_digests[0]}")

    # Again, and under a second name: same layers, nothing downloaded or built.
    gets = served.open.requests("GET /v2/busybox/blobs/")
    logs.clear()
    again = await import_image(settings, ref, name="bb", log=logs.append)
    other = await import_image(settings, ref, name="bb2")
    assert again.layers == tpl.layers == other.layers
    assert served.open.requests("GET /v2/busybox/blobs/") == gets
    assert not any("agentenv layer" in line for line in logs)
    assert [t.name for t in TemplateCatalog(settings).list()] == ["bb", "bb2"]
    assert {"template:bb", "template:bb2"} <= set(store.holders(top.layer))


def cache_chain_ids(cache: ImageCache, pushed: Pushed) -> list[str]:
    from agentenv.oci.blocks import chain_ids

    return chain_ids(pushed.diff_ids)


async def test_concurrent_imports_share_one_pull(settings: Settings, served: Served) -> None:
    ref = f"{served.open.host}/busybox:1"
    manifests = served.open.requests("GET /v2/busybox/manifests/1")
    a, b, c = await asyncio.gather(
        import_image(settings, ref, name="c1"),
        import_image(settings, ref, name="c2"),
        import_image(settings, ref, name="c3"),
    )
    assert a.layers == b.layers == c.layers
    assert served.open.requests("GET /v2/busybox/manifests/1") == manifests + 1


async def test_credentials_reach_the_registry(settings: Settings, served: Served) -> None:
    ref = f"{served.basic.host}/busybox:1"
    with pytest.raises(Unauthorized):
        await import_image(settings, ref, name="nope", credentials=(USER, "wrong"))
    with pytest.raises(Unauthorized):
        await import_image(settings, ref, name="nope")
    tpl = await import_image(settings, ref, name="authed", credentials=(USER, PASSWORD))
    assert tpl.env == BUSYBOX_ENV
    assert [t.name for t in TemplateCatalog(settings).list()] == ["authed"]


async def test_remove_template_drops_its_holds(settings: Settings, served: Served) -> None:
    ref = f"{served.open.host}/busybox:1"
    tpl = await import_image(settings, ref, name="gone")
    keep = await import_image(settings, ref, name="kept")
    cache = ImageCache.for_settings(settings)
    blob = f"blob:{served.busybox.layer_digests[0]}"
    assert {"template:gone", "template:kept"} <= set(cache.pins(blob))
    assert remove_template(settings, "gone").name == "gone"
    assert [t.name for t in TemplateCatalog(settings).list()] == ["kept"]
    assert "template:gone" not in cache.layers.holders(tpl.layers[-1])
    assert "template:gone" not in cache.pins(blob) and "template:kept" in cache.pins(blob)
    with pytest.raises(TemplateNotFound):
        remove_template(settings, "gone")
    assert keep.layers == tpl.layers
