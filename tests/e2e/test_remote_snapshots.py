"""A template snapshot captured on one data dir, pushed to SeaweedFS, pulled into a second,
empty data dir and restored into a running guest there; a sandbox paused on one data dir,
forked and resumed on another (real microVMs)."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from objstore.seaweed import SeaweedFS

from agentenv.config import Settings
from agentenv.guest.envd.client import EnvdClient
from agentenv.network import create_slot, destroy_slot
from agentenv.objstore import ObjectStore
from agentenv.snapshot import (
    ForkTarget,
    GuestImage,
    SnapshotNotFound,
    ensure_template_snapshot,
    fork_paused,
    identify,
    pause,
    release,
    repository,
    restore,
    resume,
)
from agentenv.snapshot.remote import RemoteSnapshots

pytestmark = pytest.mark.vm

MEM = 512


@pytest.fixture(scope="module")
def image() -> GuestImage:
    return GuestImage.resolve(Settings.from_env())


async def test_template_captured_on_a_restores_on_b(
    agentenv_home: Path,
    base_template: Any,
    image: GuestImage,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    settings_a = replace(Settings.from_env(), home=agentenv_home)
    settings_b = replace(Settings.from_env(), home=tmp_path_factory.mktemp("node-b-home"))
    snap = await ensure_template_snapshot(settings_a, "base", MEM, 1, image)
    with SeaweedFS() as sw:
        cfg = sw.config("agentenv-e2e")
        async with (
            ObjectStore(cfg, state_dir=settings_a.blobs_dir) as store_a,
            ObjectStore(cfg, state_dir=settings_b.blobs_dir) as store_b,
        ):
            await store_a.ensure_bucket()
            a = RemoteSnapshots.from_settings(settings_a, store_a)
            t0 = time.monotonic()
            await a.push(snap.id)
            push_s = time.monotonic() - t0
            sent = store_a.stats.bytes_uploaded
            # Pushing it again reads nothing: every file is known by its identity.
            t0 = time.monotonic()
            manifest = await a.push(snap.id)
            again_s = time.monotonic() - t0
            assert store_a.stats.bytes_uploaded == sent
            assert store_a.stats.hashes_skipped == len(manifest.blobs())

            b = RemoteSnapshots.from_settings(settings_b, store_b)
            with pytest.raises(SnapshotNotFound):
                repository(settings_b).get(snap.id)
            t0 = time.monotonic()
            pulled = await b.pull(snap.id)
            pull_s = time.monotonic() - t0
            assert pulled.id == snap.id
            got = store_b.stats.bytes_downloaded
            print(
                f"\ntemplate snapshot {snap.id[:12]}: push {sent / 2**20:.0f} MiB in "
                f"{push_s:.1f}s (again: {again_s:.2f}s), pull {got / 2**20:.0f} MiB in "
                f"{pull_s:.1f}s (verified, id recomputed)"
            )

            repo_b = repository(settings_b)
            slot = await create_slot(settings_b.network)
            name = f"remote-{int(time.time() * 1000) % 100000}"
            workdir = settings_b.sandboxes_dir / name
            machine = None
            try:
                t0 = time.monotonic()
                machine = await restore(
                    repo_b, repo_b.layers, image, snap.id, name=name, workdir=workdir, slot=slot
                )
                async with EnvdClient(machine.envd_url) as envd:
                    await identify(envd, hostname=name)
                restore_s = time.monotonic() - t0
                async with EnvdClient(machine.envd_url) as envd:
                    code, out, err = await envd.run("hostname; cat /etc/os-release", timeout=60)
                assert code == 0, err
                assert out.splitlines()[0] == name
                assert "bookworm" in out
                print(f"restored on B in {restore_s:.2f}s")
            finally:
                if machine is not None:
                    with contextlib.suppress(Exception):
                        await release(machine, repo_b, repo_b.layers)
                await destroy_slot(slot)
                await asyncio.to_thread(shutil.rmtree, workdir, True)


async def _sh(envd_url: str, cmd: str) -> str:
    async with EnvdClient(envd_url) as envd:
        code, out, err = await envd.run(cmd, user="root", timeout=60)
    assert code == 0, f"{cmd!r} failed ({code}): {err}"
    return str(out).strip()


async def test_sandbox_paused_on_a_resumes_on_b(
    agentenv_home: Path,
    base_template: Any,
    image: GuestImage,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """Files, processes and RAM-only state survive: pause on A, push, pull into B, resume."""
    settings_a = replace(Settings.from_env(), home=agentenv_home)
    settings_b = replace(Settings.from_env(), home=tmp_path_factory.mktemp("node-b-paused"))
    snap = await ensure_template_snapshot(settings_a, "base", MEM, 1, image)
    repo_a, repo_b = repository(settings_a), repository(settings_b)
    name = f"moving-{int(time.time() * 1000) % 100000}"
    workdir_a = settings_a.sandboxes_dir / name
    workdir_b = settings_b.sandboxes_dir / name
    slots = [await create_slot(settings_a.network)]
    machines: list[tuple[Any, Any]] = []
    try:
        m = await restore(
            repo_a, repo_a.layers, image, snap.id, name=name, workdir=workdir_a, slot=slots[0]
        )
        machines.append((m, repo_a))
        async with EnvdClient(m.envd_url) as envd:
            await identify(envd, hostname=name)
        await _sh(m.envd_url, "echo on-disk > /root/file; echo in-ram > /tmp/ram-only")
        pid = await _sh(m.envd_url, "setsid nohup sleep 100000 >/dev/null 2>&1 & echo $!")
        record = await pause(m, repo_a, image)
        machines.clear()
        assert record.kind == "stream"
        with SeaweedFS() as sw:
            cfg = sw.config("agentenv-e2e-paused")
            async with (
                ObjectStore(cfg, state_dir=settings_a.blobs_dir) as store_a,
                ObjectStore(cfg, state_dir=settings_b.blobs_dir) as store_b,
            ):
                await store_a.ensure_bucket()
                t0 = time.monotonic()
                await RemoteSnapshots.from_settings(settings_a, store_a).push_paused(
                    workdir_a, name
                )
                push_s = time.monotonic() - t0
                t0 = time.monotonic()
                await RemoteSnapshots.from_settings(settings_b, store_b).pull_paused(
                    name, workdir_b
                )
                pull_s = time.monotonic() - t0
                print(
                    f"\npaused sandbox: push {store_a.stats.bytes_uploaded / 2**20:.0f} MiB in "
                    f"{push_s:.1f}s, pull {store_b.stats.bytes_downloaded / 2**20:.0f} MiB in "
                    f"{pull_s:.1f}s"
                )
        # A fork of the paused sandbox where it was pulled to (#24): the child has its files,
        # processes and RAM; the RAM stream is converted first; the parent stays paused.
        slots.append(await create_slot(settings_b.network))
        kid = f"{name}-kid"
        forked = await fork_paused(
            workdir_b,
            [ForkTarget(kid, settings_b.sandboxes_dir / kid, slots[-1])],
            repo_b,
            repo_b.layers,
            image,
        )
        child = forked.children[0]
        machines.append((child, repo_b))
        print(f"forked 1 from the paused copy on B in {forked.total_s:.2f}s")
        assert await _sh(child.envd_url, "cat /root/file; cat /tmp/ram-only; hostname") == (
            f"on-disk\nin-ram\n{kid}"
        )
        assert await _sh(child.envd_url, f"cat /proc/{pid}/cmdline | tr '\\0' ' '") == (
            "sleep 100000"
        )
        await _sh(child.envd_url, "echo child > /root/file; echo child > /tmp/ram-only")
        assert (workdir_b / "paused.json").is_file()
        slots.append(await create_slot(settings_b.network))
        t0 = time.monotonic()
        moved = await resume(workdir_b, image, slots[-1])
        machines.append((moved, repo_b))
        print(f"resumed on B in {time.monotonic() - t0:.2f}s")
        assert await _sh(moved.envd_url, "cat /root/file") == "on-disk"
        assert await _sh(moved.envd_url, "cat /tmp/ram-only") == "in-ram"
        assert await _sh(moved.envd_url, f"cat /proc/{pid}/cmdline | tr '\\0' ' '") == (
            "sleep 100000"
        )
    finally:
        for machine, repo in machines:
            with contextlib.suppress(Exception):
                await release(machine, repo, repo.layers)
        for slot in slots:
            await destroy_slot(slot)
        repo_a.layers.unref_holder(name)
        repo_b.layers.unref_holder(name)
        repo_b.layers.unref_holder(f"{name}-kid")
        for wd in (workdir_a, workdir_b, settings_b.sandboxes_dir / f"{name}-kid"):
            await asyncio.to_thread(shutil.rmtree, wd, True)
