"""The distribution client against a real docker-registry on 127.0.0.1."""

from __future__ import annotations

import asyncio
import hashlib
import json
from pathlib import Path

import pytest

from agentenv.oci import manifest as mf
from agentenv.oci.auth import Credentials
from agentenv.oci.cache import ImageCache
from agentenv.oci.client import RegistryClient, RegistryConfig
from agentenv.oci.errors import (
    DigestMismatch,
    ManifestUnknown,
    PlatformNotFound,
    SizeMismatch,
    Unauthorized,
)
from agentenv.oci.pull import pull
from agentenv.oci.reference import parse

from .conftest import PASSWORD, USER, Images, Registries, blob_data_path
from .images import Layer, Pusher
from .proxy import CuttingProxy


def _file_sha(path: Path) -> str:
    return "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()


async def test_pull_oci_image_checks_every_blob(
    registries: Registries, images: Images, cache: ImageCache
) -> None:
    got = await pull(cache, f"{registries.open.host}/app:1")
    assert got.manifest_digest == images.app.manifest_digest
    assert got.reference.digest == images.app.manifest_digest
    assert got.layer_blobs == tuple(images.app.layer_digests)
    for digest, path in zip(got.layer_blobs, got.blob_paths, strict=True):
        assert _file_sha(path) == digest
        assert path.stat().st_mode & 0o777 == 0o444
    assert list(got.config.diff_ids) == images.app.diff_ids
    # The config became typed defaults.
    assert got.config.env_dict == {"PATH": "/usr/local/bin:/usr/bin", "EQ": "a=b"}
    assert got.config.working_dir == "/app"
    assert got.config.user == "1000:1000"
    assert got.config.command == ("python3", "-m", "http.server", "8080")
    assert got.config.exposed_ports == ((53, "udp"), (8080, "tcp"))
    record = json.loads(cache.image_record(got.manifest_digest).read_text())
    assert record["layers"] == images.app.layer_digests
    # Nothing stays pinned once the pull is over.
    assert all(not cache.pins(k) for k in cache.image_keys(got.manifest_digest))


async def test_docker_media_types_and_multi_arch_index(
    registries: Registries, images: Images, cache: ImageCache
) -> None:
    docker = await pull(cache, f"{registries.open.host}/dockerimg:1")
    assert docker.layer_blobs == tuple(images.docker.layer_digests)
    multi = await pull(cache, f"{registries.open.host}/multi:1")
    assert multi.index_digest is not None
    # The amd64 entry, not the arm64 one listed first.
    assert multi.config.platform.architecture == "amd64"
    assert len(multi.layer_blobs) == 3
    # The two layers shared with dockerimg:1 were already cached: only the third layer
    # and the config came over the wire.
    l3a = len(images.layers["l3a"][0])
    assert l3a < multi.downloaded_bytes < l3a + 4096


async def test_index_without_amd64_is_refused(registries: Registries, images: Images) -> None:
    async with RegistryClient() as rc:
        with pytest.raises(PlatformNotFound, match=r"no linux/amd64 .*linux/arm64"):
            await rc.resolve(parse(f"{registries.open.host}/armonly:1"))


async def test_unknown_tag_names_the_reference(registries: Registries, images: Images) -> None:
    async with RegistryClient() as rc:
        with pytest.raises(ManifestUnknown, match=rf"{registries.open.host}/app:nope"):
            await rc.resolve(parse(f"{registries.open.host}/app:nope"))


async def test_basic_auth(registries: Registries, images: Images, cache: ImageCache) -> None:
    ref = f"{registries.basic.host}/app:1"
    with pytest.raises(Unauthorized, match="wants a username and password"):
        await pull(cache, ref, config=RegistryConfig())
    wrong = RegistryConfig(credentials={registries.basic.host: Credentials(USER, "wrong")})
    with pytest.raises(Unauthorized, match=f"refused access as '{USER}'"):
        await pull(cache, ref, config=wrong)
    good = RegistryConfig(credentials={registries.basic.host: Credentials(USER, PASSWORD)})
    got = await pull(cache, ref, config=good)
    assert got.manifest_digest == images.app.manifest_digest


async def test_bearer_token_auth(registries: Registries, images: Images, cache: ImageCache) -> None:
    issuer = registries.issuer
    ref = f"{registries.token.host}/app:1"
    before = len(issuer.requests)
    with pytest.raises(Unauthorized, match="refused anonymous access"):
        await pull(cache, ref, config=RegistryConfig())
    wrong = RegistryConfig(credentials={registries.token.host: Credentials(USER, "nope")})
    with pytest.raises(Unauthorized, match=f"refused user '{USER}'"):
        await pull(cache, ref, config=wrong)
    good = RegistryConfig(credentials={registries.token.host: Credentials(USER, PASSWORD)})
    async with RegistryClient(good, cache) as rc:
        got = await pull(cache, ref, client=rc)
        assert got.manifest_digest == images.app.manifest_digest
        # One token for the repository's pull scope, reused by every blob of the pull.
        assert rc.auth.token_requests == 1
    scopes = {r.get("scope") for r in issuer.requests[before:]}
    assert scopes == {"repository:app:pull"}
    assert all(r.get("service") == issuer.SERVICE for r in issuer.requests[before:])


async def test_digest_mismatch_names_the_blob(
    registries: Registries, images: Images, cache: ImageCache
) -> None:
    pusher = Pusher(registries.open.url)
    try:
        layer = Layer().file("c.txt", b"corrupt me " * 1000).blob("gzip")
        pushed = pusher.image("corrupt", "1", [layer])
    finally:
        pusher.close()
    data = blob_data_path(registries.storage, pushed.layer_digests[0])
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # same size, different bytes
    data.write_bytes(bytes(raw))
    with pytest.raises(DigestMismatch, match=pushed.layer_digests[0]):
        await pull(cache, f"{registries.open.host}/corrupt:1")
    assert not cache.has_blob(pushed.layer_digests[0])
    assert not cache.partial_path(pushed.layer_digests[0]).exists()


async def test_size_mismatch(registries: Registries, images: Images, cache: ImageCache) -> None:
    pusher = Pusher(registries.open.url)
    try:
        layer = Layer().file("s.txt", b"size " * 3000).blob("gzip")
        pusher.image("sizelie", "short", [layer], sizes={0: len(layer[0]) - 7})
        pusher.image("sizelie", "long", [layer], sizes={0: len(layer[0]) + 7})
    finally:
        pusher.close()
    with pytest.raises(SizeMismatch, match="more than the"):
        await pull(cache, f"{registries.open.host}/sizelie:short")
    with pytest.raises(SizeMismatch, match=f"received {len(layer[0])} bytes"):
        await pull(cache, f"{registries.open.host}/sizelie:long")


async def test_resume_from_a_partial_file(
    registries: Registries, images: Images, cache: ImageCache
) -> None:
    desc_digest = images.big.layer_digests[0]
    full = images.big.layer_bytes[0]
    cache.ensure_dirs()
    kept = len(full) * 2 // 3
    cache.partial_path(desc_digest).write_bytes(full[:kept])
    async with RegistryClient(RegistryConfig(), cache) as rc:
        got = await pull(cache, f"{registries.open.host}/big:1", client=rc)
        assert rc.stats.range_requests == 1
        # The rest of the layer, plus the small config blob.
        assert len(full) - kept < got.downloaded_bytes < len(full) - kept + 4096
    assert _file_sha(cache.blob_path(desc_digest)) == desc_digest


async def test_resume_after_a_cut_connection(
    registries: Registries, images: Images, cache: ImageCache
) -> None:
    full = images.big.layer_bytes[0]
    # The first connection that carries a blob is cut after 3 MB of response.
    async with (
        CuttingProxy(registries.open.port, cut_after=3 * 1024 * 1024) as proxy,
        RegistryClient(RegistryConfig(), cache) as rc,
    ):
        got = await pull(cache, f"127.0.0.1:{proxy.port}/big:1", client=rc)
        assert proxy.cuts == 1
        assert rc.stats.range_requests >= 1
        # The part received before the cut was not fetched again.
        assert rc.stats.bytes_downloaded < len(full) + 1024 * 1024
    assert _file_sha(got.blob_paths[0]) == images.big.layer_digests[0]
    assert any(h.startswith("bytes=") for h in proxy.ranges)


async def test_concurrent_pulls_download_once(
    registries: Registries, images: Images, cache: ImageCache
) -> None:
    digest = images.big.layer_digests[0]
    needle = f"GET /v2/big/blobs/{digest}"
    before = registries.open.requests(needle)
    async with RegistryClient(RegistryConfig(), cache) as rc:
        results = await asyncio.gather(
            *(pull(cache, f"{registries.open.host}/big:1", client=rc) for _ in range(4))
        )
        assert rc.stats.blobs_fetched == 2  # the layer and the config, once each
        assert rc.stats.blob_hits == 6
    assert {r.manifest_digest for r in results} == {images.big.manifest_digest}
    assert registries.open.requests(needle) - before == 1


async def test_mirror_first_then_origin(
    registries: Registries, images: Images, cache: ImageCache, tmp_path: Path
) -> None:
    from .registry import Registry

    # An empty registry as the mirror: everything falls through to the origin.
    mirror = Registry.start(tmp_path / "mirror", tmp_path / "mirror-storage")
    try:
        origin = registries.open.host
        config = RegistryConfig(mirrors={origin: (mirror.url,)})
        got = await pull(cache, f"{origin}/other:1", config=config)
        assert got.manifest_digest == images.other.manifest_digest
        assert mirror.requests("GET /v2/other/manifests/1") == 1
        # A mirror that has the image serves it; the origin is not asked for the manifest.
        pusher = Pusher(mirror.url)
        try:
            layer = Layer().file("m", b"from the mirror").blob("gzip")
            pushed = pusher.image("onlymirror", "1", [layer])
        finally:
            pusher.close()
        got2 = await pull(cache, f"{origin}/onlymirror:1", config=config)
        assert got2.manifest_digest == pushed.manifest_digest
        assert registries.open.requests("GET /v2/onlymirror/manifests/1") == 0
    finally:
        mirror.stop()


async def test_scheme_rule() -> None:
    rc = RegistryClient(RegistryConfig(insecure=frozenset({"reg.internal:5000"})))
    try:
        assert rc.endpoints(parse("127.0.0.1:5000/a"))[0].base == "http://127.0.0.1:5000"
        assert rc.endpoints(parse("localhost:5000/a"))[0].base == "http://localhost:5000"
        assert rc.endpoints(parse("[::1]:5000/a"))[0].base == "http://[::1]:5000"
        assert rc.endpoints(parse("reg.internal:5000/a"))[0].base == "http://reg.internal:5000"
        assert rc.endpoints(parse("quay.io/a/b"))[0].base == "https://quay.io"
        assert rc.endpoints(parse("ubuntu"))[0].base == "https://registry-1.docker.io"
    finally:
        await rc.close()


def test_accept_header_lists_all_manifest_types() -> None:
    for t in (mf.OCI_MANIFEST, mf.OCI_INDEX, mf.DOCKER_MANIFEST, mf.DOCKER_LIST):
        assert t in mf.ACCEPT


async def test_a_pull_cancelled_while_hashing_leaves_no_partial_file(
    registries: Registries, images: Images, cache: ImageCache, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The window CI hit: a layer fully received and being hashed (in a thread) when another
    # layer's failure cancels the pull. The hash is held open so the cancel lands inside it.
    import threading

    from agentenv.oci import client as client_mod

    hashing = threading.Event()
    release = threading.Event()
    real = client_mod._sha256_file

    digest = images.big.layer_digests[0]

    def slow_sha(path: Path) -> str:
        if path == cache.partial_path(digest):  # the config blob is hashed too
            hashing.set()
            release.wait(30)
        return real(path)

    monkeypatch.setattr(client_mod, "_sha256_file", slow_sha)
    task = asyncio.create_task(pull(cache, f"{registries.open.host}/big:1"))
    try:
        assert await asyncio.to_thread(hashing.wait, 60)
        assert cache.partial_path(digest).exists()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    finally:
        release.set()
    assert not cache.partial_path(digest).exists()
    assert not cache.has_blob(digest)
