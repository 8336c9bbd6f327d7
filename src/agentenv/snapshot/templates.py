"""A template is a snapshot: boot the template's disk once, wait for envd, capture.

Sandboxes are then created by restoring that snapshot, never by booting a kernel. The
snapshot is named ``<template>.<cpu>c.<memory>m`` (RAM size and vCPU count are fixed in a
snapshot, so each shape is its own) and carries a build key over everything the guest was
booted from; while that key is unchanged `ensure_template_snapshot` does no work.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import secrets
import shutil

from agentenv.config import Settings
from agentenv.faults import crash_point
from agentenv.filelock import file_lock
from agentenv.files import ROOTFS, snapshots_dir
from agentenv.network import create_slot, destroy_slot
from agentenv.snapshot.capture import capture
from agentenv.snapshot.errors import CaptureFailed, SnapshotNotFound
from agentenv.snapshot.machine import GuestImage, boot
from agentenv.snapshot.model import Snapshot
from agentenv.snapshot.repository import SnapshotRepository
from agentenv.snapshot.warmup import start_failures, warm_up
from agentenv.storage import LayerStore, create_upper
from agentenv.template.catalog import TemplateCatalog

log = logging.getLogger(__name__)

# Bump when the way a template snapshot is made changes.
# 2: the balloon device no longer offers free page reporting to file-backed guests.
# 3: free page reporting for every guest again (clones discard through vmm.ramshim).
# 4: every slot's tap has one MAC (config.GATEWAY_MAC), the one a template's guest keeps.
# 5: the guest has run a first command, file write and read before its capture (`warmup`).
RECIPE = "5"
# A waiter for another process's build gives up after this many boot timeouts (a cold boot
# under TCG plus the capture).
BUILD_LOCK_BOOTS = 3


def repository(settings: Settings) -> SnapshotRepository:
    return SnapshotRepository(snapshots_dir(settings), LayerStore(settings.layers_dir))


def template_alias(template: str, cpu: int, memory_mb: int) -> str:
    return f"{template}.{cpu}c.{memory_mb}m"


def build_key(image: GuestImage, layers: list[str], template_key: str, cpu: int, mem: int) -> str:
    inputs = {
        "recipe": RECIPE,
        "layers": layers,
        "template": template_key,
        "kernel": str(image.kernel),
        "initrd": str(image.initrd),
        "tools": str(image.tools_image),
        "cmdline": image.cmdline("template"),
        "accel": image.accel.name,
        "qemu": image.qemu_version,
        "shape": [cpu, mem],
    }
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:32]


def find_template_snapshot(
    settings: Settings, image: GuestImage, template: str, cpu: int, memory_mb: int
) -> Snapshot | None:
    """The current snapshot of this template shape, or None if it needs (re)building."""
    tpl = TemplateCatalog(settings).get(template)
    key = build_key(image, tpl.layers, tpl.build_key, cpu, memory_mb)
    try:
        snap = repository(settings).get(template_alias(template, cpu, memory_mb))
    except SnapshotNotFound:
        return None
    return snap if snap.build_key == key else None


async def ensure_template_snapshot(
    settings: Settings,
    name: str = "base",
    memory_mb: int = 512,
    cpu: int = 1,
    image: GuestImage | None = None,
) -> Snapshot:
    """The snapshot sandboxes of template `name` start from, built if missing or stale.

    Raises `TemplateNotFound` for an unknown template. A current snapshot is returned
    without locking; builds of one template shape are serialised across processes by a lock
    file (`filelock`: waiters wait in asyncio, up to three boot timeouts, then
    `LockTimeout`)."""
    if image is None:
        image = await asyncio.to_thread(GuestImage.resolve, settings)
    tpl = await asyncio.to_thread(TemplateCatalog(settings).get, name)
    key = build_key(image, tpl.layers, tpl.build_key, cpu, memory_mb)
    alias = template_alias(name, cpu, memory_mb)
    repo = repository(settings)
    with contextlib.suppress(SnapshotNotFound):
        snap = await asyncio.to_thread(repo.get, alias)
        if snap.build_key == key:
            return snap
    root = snapshots_dir(settings)
    await asyncio.to_thread(root.mkdir, 0o755, True, True)
    async with file_lock(
        root / f".build-{alias}.lock",
        name=f"the template build lock of {alias}",
        timeout_s=image.boot_timeout_s * BUILD_LOCK_BOOTS,
        waiter=f"snapshot of template {name!r}",
    ):
        # Someone else may have built it while we waited.
        with contextlib.suppress(SnapshotNotFound):
            snap = await asyncio.to_thread(repo.get, alias)
            if snap.build_key == key:
                return snap
        return await _build(
            settings, image, repo, tpl.layers[-1], name, alias, key, cpu, memory_mb, tpl.user
        )


async def _build(
    settings: Settings,
    image: GuestImage,
    repo: SnapshotRepository,
    top_layer: str,
    template: str,
    alias: str,
    key: str,
    cpu: int,
    memory_mb: int,
    user: str | None,
) -> Snapshot:
    vm_name = f"tpl-{template[:20]}-{secrets.token_hex(4)}"
    workdir = snapshots_dir(settings) / f".build-{vm_name}"
    layers = repo.layers
    slot = await create_slot(settings.network, owner=settings.slots_dir)
    try:
        await asyncio.to_thread(workdir.mkdir, 0o700)
        await asyncio.to_thread(layers.ref, top_layer, vm_name)
        upper = workdir / ROOTFS
        await create_upper(await asyncio.to_thread(layers.path, top_layer), upper, None)
        machine = await boot(
            image,
            name=vm_name,
            workdir=workdir,
            vcpus=cpu,
            memory_mb=memory_mb,
            upper=upper,
            slot=slot,
            hostname=template,
        )
        vm = machine.vm
        try:
            crash_point("template:booted")
            failures = await start_failures(machine.envd_url)
            if failures is not None:
                raise CaptureFailed(f"template {alias}: not captured: start hook {failures}")
            await warm_up(machine.envd_url, user)
            cap = await capture(
                machine,
                repo,
                layers,
                image,
                keep_running=False,
                names=[alias],
                source=f"template:{template}",
                build_key=key,
            )
        finally:
            await vm.kill()
        log.info(
            "template %s: snapshot %s (%d MB of RAM image)",
            alias,
            cap.snapshot.id[:12],
            cap.snapshot.memory_bytes // (1024 * 1024),
        )
        return cap.snapshot
    finally:
        await destroy_slot(slot, owner=settings.slots_dir)
        with contextlib.suppress(Exception):
            await asyncio.to_thread(layers.unref_holder, vm_name)
        await asyncio.to_thread(shutil.rmtree, workdir, True)
