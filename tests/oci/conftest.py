"""Session registries on 127.0.0.1 (open, htpasswd, bearer token) over one storage dir, and
the test images pushed to them."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from agentenv.oci.cache import ImageCache
from agentenv.storage.layers import LayerStore

from .images import Layer, Pushed, Pusher
from .registry import REGISTRY_BIN, Registry, TokenIssuer

USER = "alice"
PASSWORD = "s3cret-pw"


@dataclass
class Registries:
    storage: Path
    open: Registry
    basic: Registry
    token: Registry
    issuer: TokenIssuer


@dataclass
class Images:
    app: Pushed
    other: Pushed
    docker: Pushed
    arm: Pushed
    big: Pushed
    multi_tag: str
    armonly_tag: str
    layers: dict[str, tuple[bytes, str, str]]


def base_layer() -> Layer:
    return (
        Layer()
        .dir("usr").dir("usr/lib").dir("usr/bin").dir("etc").dir("dev").dir("run")
        .symlink("lib", "usr/lib")
        .symlink("bin", "usr/bin")
        .file("usr/bin/tool", b"#!/bin/sh\necho tool\n", 0o755,
              xattrs={"user.note": "hello", "trusted.t": "1"})
        .hardlink("usr/bin/tool2", "usr/bin/tool")
        .file("usr/bin/su", b"setuid", 0o4755)
        .dir("home").dir("home/user", 0o700, 1000, 1000)
        .file("home/user/.profile", b"export X=1\n", 0o600, 1000, 1000)
        .device("dev/null", True, 1, 3)
        .device("dev/loopx", False, 7, 0, 0o660)
        .fifo("run/fifo")
        .file("etc/passwd", b"root:x:0:0::/root:/bin/sh\n")
        .file("etc/old", b"to be deleted\n")
        .dir("var").dir("var/cache")
        .file("var/cache/x", b"x").file("var/cache/y", b"y")
        .symlink("etc/abs-link", "/etc/passwd")
    )  # fmt: skip


def second_layer() -> Layer:
    return (
        Layer()
        .file("lib/extra.so", b"\x7fELF extra", 0o755)  # through the lib -> usr/lib symlink
        .whiteout("etc/old")
        .opaque("var/cache")
        .file("var/cache/z", b"z")
        .file("etc/passwd", b"root:x:0:0::/root:/bin/sh\nuser:x:1000:1000::/home/user:/bin/sh\n")
    )


@pytest.fixture(scope="session")
def registries(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Registries]:
    if not os.path.exists(REGISTRY_BIN) or not shutil.which("htpasswd"):
        pytest.fail("docker-registry and apache2-utils are needed: scripts/test installs them")
    root = tmp_path_factory.mktemp("registries")
    storage = root / "storage"
    started: list[Registry] = []
    issuer = TokenIssuer(root / "issuer", {USER: PASSWORD})
    try:
        open_reg = Registry.start(root / "open", storage)
        started.append(open_reg)
        basic = Registry.start_basic(root / "basic", storage, USER, PASSWORD)
        started.append(basic)
        token = Registry.start(root / "token", storage, issuer.registry_auth())
        started.append(token)
        yield Registries(storage, open_reg, basic, token, issuer)
    finally:
        for reg in started:
            reg.stop()
        issuer.stop()


@pytest.fixture(scope="session")
def images(registries: Registries) -> Iterator[Images]:
    pusher = Pusher(registries.open.url)
    try:
        l1 = base_layer().blob("gzip")
        l2 = second_layer().blob("gzip")
        l3a = Layer().dir("app").file("app/main.py", b"print('app')\n").blob("zstd")
        l3b = Layer().dir("other").file("other/x", b"other\n").blob("none")
        big = Layer().file("big.bin", os.urandom(24 * 1024 * 1024)).blob("gzip")
        cfg = {
            "Env": ["PATH=/usr/local/bin:/usr/bin", "EQ=a=b"],
            "WorkingDir": "/app",
            "User": "1000:1000",
            "Entrypoint": ["python3"],
            "Cmd": ["-m", "http.server", "8080"],
            "ExposedPorts": {"8080/tcp": {}, "53/udp": {}},
        }
        app = pusher.image("app", "1", [l1, l2, l3a], **cfg)
        other = pusher.image("other", "1", [l1, l2, l3b])
        docker = pusher.image("dockerimg", "1", [l1, l2], docker=True)
        arm = pusher.image("multi", "arm64-only", [l1], arch="arm64", push_tag=False)
        app_in_multi = pusher.image("multi", "amd64", [l1, l2, l3a], **cfg)
        pusher.index("multi", "1", [(arm, "arm64"), (app_in_multi, "amd64")])
        pusher.index("armonly", "1", [(pusher.image("armonly", "x", [l1], arch="arm64"), "arm64")])
        bigimg = pusher.image("big", "1", [big])
        yield Images(app, other, docker, arm, bigimg, "1", "1",
                     {"l1": l1, "l2": l2, "l3a": l3a, "l3b": l3b})  # fmt: skip
    finally:
        pusher.close()


@pytest.fixture
def cache(tmp_path: Path) -> ImageCache:
    return ImageCache(tmp_path / "oci", LayerStore(tmp_path / "layers"))


def blob_data_path(storage: Path, digest: str) -> Path:
    """Where docker-registry's filesystem driver keeps a blob's bytes."""
    hexd = digest.split(":", 1)[1]
    return storage / "docker/registry/v2/blobs/sha256" / hexd[:2] / hexd / "data"
