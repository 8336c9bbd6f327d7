"""Sandboxes of image templates (`template.image.import_image`): a static busybox image with
no libc and a Debian image made from the base rootfs, pulled from a registry on loopback,
booted by `Node.create`, commands run through envd. Create = restore of the template snapshot,
as for `base`; a cold boot (snapshots off) gets the same defaults."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
from oci.images import Pushed, Pusher
from oci.registry import REGISTRY_BIN, Registry
from template.imagebuild import BUSYBOX_ENV, DEBIAN_ENV, push_busybox, push_debian

from agentenv.config import Settings
from agentenv.guest.envd.client import EnvdClient
from agentenv.node.host import Node, SandboxHandle
from agentenv.snapshot.templates import find_template_snapshot
from agentenv.storage.layers import LayerStore
from agentenv.template.image import import_image

pytestmark = pytest.mark.vm

MEM = 512


@dataclass
class Served:
    registry: Registry
    busybox: Pushed


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    if not Path(REGISTRY_BIN).exists():
        pytest.fail("docker-registry is needed: scripts/test installs it")
    root = tmp_path_factory.mktemp("image-templates")
    reg = Registry.start(root / "registry", root / "storage")
    try:
        pusher = Pusher(reg.url)
        try:
            busybox = push_busybox(pusher)
        finally:
            pusher.close()
        yield Served(reg, busybox)
    finally:
        reg.stop()


async def run(sb: SandboxHandle, cmd: str, user: str | None = None) -> str:
    """`cmd` through the SDK's shell (`/bin/bash -l -c`), as envd's default user unless
    `user` is given."""
    async with EnvdClient(sb.envd_url) as envd:
        code, out, err = await envd.run(cmd, user=user, timeout=60)
    assert code == 0, f"{cmd!r} exited {code}: {err}"
    return out.strip()


async def check_busybox(sb: SandboxHandle) -> None:
    assert await run(sb, 'echo "$GREETING|$EQ|$PATH"') == (
        f"{BUSYBOX_ENV['GREETING']}|{BUSYBOX_ENV['EQ']}|{BUSYBOX_ENV['PATH']}"
    )
    assert await run(sb, "pwd") == "/app"
    assert await run(sb, "id -un; id -u; echo $HOME") == "user\n1000\n/home/user"
    assert await run(sb, "id -u", user="root") == "0"
    assert await run(sb, "cat /app/data.txt /etc/motd") == "from layer two\nbusybox image"
    # The whiteout in layer two deleted it; the image has no libc at all.
    assert await run(sb, "test -e /etc/old.txt; echo $?") == "1"
    assert await run(sb, "ls /lib /usr/lib 2>/dev/null | wc -l") == "0"
    # /bin/bash is the busybox shim (the image has none), and the tools layer is mounted.
    assert "busybox sh" in await run(sb, "cat /bin/bash")
    assert await run(sb, "hostname") == sb.id
    # The user's writes land in the sandbox's own upper, also in its home.
    assert await run(sb, "echo hi > ~/f && cat ~/f") == "hi"


async def test_busybox_image_template_restore(
    settings: Settings, served: Served, capsys: pytest.CaptureFixture[str]
) -> None:
    ref = f"{served.registry.host}/busybox:1"
    t0 = time.monotonic()
    tpl = await import_image(settings, ref, name="img-busybox")
    import_s = time.monotonic() - t0
    node = Node(settings)
    await node.start()
    handles: list[SandboxHandle] = []
    try:
        t0 = time.monotonic()
        sb = await node.create("img-busybox", memory_mb=MEM)
        first_s = time.monotonic() - t0
        handles.append(sb)
        assert sb.origin in ("restore", "warm")
        snap = find_template_snapshot(settings, node.image, "img-busybox", 1, MEM)
        assert snap is not None and snap.top_layer != tpl.layers[-1]  # its own sealed upper
        await check_busybox(sb)
        t0 = time.monotonic()
        sb2 = await node.create("img-busybox", memory_mb=MEM)
        second_s = time.monotonic() - t0
        handles.append(sb2)
        assert sb2.origin in ("restore", "warm")
        # The first sandbox's write is not in the second's disk.
        assert await run(sb2, "cat ~/f 2>/dev/null || echo none") == "none"
        await check_busybox(sb2)

        # A filesystem-only pause: the resume boots a fresh envd, which gets the defaults
        # again (recorded in the sandbox's meta at create).
        await node.pause(sb.id, memory=False)
        t0 = time.monotonic()
        sb = await node.resume(sb.id)
        resume_s = time.monotonic() - t0
        assert sb.booted
        assert await run(sb, "cat ~/f") == "hi"
        await check_busybox(sb)

        # Importing again reuses everything, and the template snapshot stays current.
        again = await import_image(settings, ref, name="img-busybox")
        assert again.layers == tpl.layers
        now = find_template_snapshot(settings, node.image, "img-busybox", 1, MEM)
        assert now is not None and now.id == snap.id
        for h in handles:
            await node.delete(h.id)
        handles.clear()
    finally:
        for h in handles:
            await node.delete(h.id)
        await node.close()
    with capsys.disabled():
        print(
            f"\nbusybox image: import {import_s:.2f}s, first create (snapshot build) "
            f"{first_s:.2f}s, second create {second_s:.2f}s ({sb2.origin}), "
            f"filesystem-only resume {resume_s:.2f}s"
        )


async def test_busybox_image_template_cold_boot(
    settings: Settings, served: Served, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without snapshots, the defaults reach a cold-booted envd the same way."""
    cold = replace(settings, snapshots=False, warm_low=0, warm_high=0)
    await import_image(cold, f"{served.registry.host}/busybox:1", name="img-busybox-cold")
    async with Node(cold) as node:
        t0 = time.monotonic()
        sb = await node.create("img-busybox-cold", memory_mb=MEM)
        boot_s = time.monotonic() - t0
        try:
            assert sb.origin == "boot"
            await check_busybox(sb)
        finally:
            await node.delete(sb.id)
    with capsys.disabled():
        print(f"\nbusybox image: cold boot create {boot_s:.2f}s")


async def test_debian_image_template(
    settings: Settings,
    served: Served,
    base_template: Any,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    layer = LayerStore(settings.layers_dir).path(base_template.layers[0])
    t0 = time.monotonic()
    pusher = Pusher(served.registry.url)
    try:
        push_debian(pusher, layer, tmp_path)
    finally:
        pusher.close()
    push_s = time.monotonic() - t0
    t0 = time.monotonic()
    tpl = await import_image(settings, f"{served.registry.host}/debian-app:1", name="img-debian")
    import_s = time.monotonic() - t0
    assert tpl.env == DEBIAN_ENV and tpl.workdir == "/app" and tpl.user == "user"
    node = Node(settings)
    await node.start()
    try:
        t0 = time.monotonic()
        sb = await node.create("img-debian", memory_mb=MEM)
        first_s = time.monotonic() - t0
        try:
            assert sb.origin in ("restore", "warm")
            assert await run(sb, "python3 hello.py") == "hello from the image"
            assert await run(sb, "echo $APP_MODE") == "test"
            # envd starts the process with the image's PATH; Debian's /etc/profile then sets
            # its own for the login shell the SDK asks for (`bash -l`), as on E2B.
            environ = await run(sb, "tr '\\0' '\\n' < /proc/$$/environ | grep ^PATH=")
            assert environ == f"PATH={DEBIAN_ENV['PATH']}"
            assert await run(sb, "id -un; pwd") == "user\n/app"
            # The base rootfs's own user and sudo (kept, not recreated), and a real bash.
            assert await run(sb, "sudo -n id -u") == "0"
            assert (await run(sb, "echo $BASH_VERSION")).startswith("5.")
            assert await run(sb, "test -e /etc/motd; echo $?") == "1"
        finally:
            await node.delete(sb.id)
        t0 = time.monotonic()
        sb = await node.create("img-debian", memory_mb=MEM)
        second_s = time.monotonic() - t0
        try:
            assert sb.origin in ("restore", "warm")
            assert (await run(sb, "cat /etc/debian_version")).startswith("12")
        finally:
            await node.delete(sb.id)
    finally:
        await node.close()
    with capsys.disabled():
        print(
            f"\ndebian image: export+push {push_s:.2f}s, import {import_s:.2f}s, first create "
            f"{first_s:.2f}s, second create {second_s:.2f}s"
        )
