"""Template builds from images that go wrong, through the unmodified SDK against a live server:
each one ends `error` with a `reason` naming the step (`Template.build` raises BuildException
with its message), and leaves nothing behind: no sandbox, no QEMU, no partial blob, no
scratch files or loop devices of a block layer build, no orphan layer or snapshot.

Registries are Debian's docker-registry on 127.0.0.1 (one open, one with htpasswd basic
auth, over one storage dir). The pull failures boot no VM; the RUN failures boot one build
sandbox each. A full host disk is a small tmpfs the test mounts over the image cache's
blob dir (a download runs out of space) or its scratch dir (a block layer build does), and
unmounts again: it must not be busy, and the server must go on working.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from api.conftest import (
    REQUEST_TIMEOUT_S,
    env_unchanged,
    qemu_processes,
    stop_and_check,
    use_sdk_env,
)
from e2b import BuildException, Template
from e2b.template.types import TemplateBuildStatus
from oci.images import Layer, Pushed, Pusher
from oci.registry import REGISTRY_BIN, Registry
from template.imagebuild import busybox_layers, push_busybox

from agentenv.api.devserver import ServerProcess
from agentenv.snapshot.repository import _STAGING_PREFIX, SnapshotRepository
from agentenv.storage.layers import LayerStore
from agentenv.template.datadir import prepare_home

pytestmark = pytest.mark.vm

BUILD_DEADLINE_S = 900.0
MIB = 1024 * 1024
# A layer that compresses to a few hundred KB and needs 64 MB once unpacked.
FILL_BYTES = 64 * MIB
NUMBERS: dict[str, object] = {}
REASONS: dict[str, str] = {}
USER = "alice"
PASSWORD = "s3cret-pw"


def blob_data_path(storage: Path, digest: str) -> Path:
    """Where docker-registry's filesystem driver keeps a blob's bytes."""
    hexd = digest.split(":", 1)[1]
    return storage / "docker/registry/v2/blobs/sha256" / hexd[:2] / hexd / "data"


@dataclass
class Env:
    server: ServerProcess
    open: Registry
    basic: Registry
    storage: Path
    corrupt: Pushed


def _fill_layer() -> tuple[bytes, str, str]:
    unit = b"agentenv-fill-0123456789abcdef\n" * 4096
    return Layer().dir("fill").file("fill/data", unit * (FILL_BYTES // len(unit))).blob("gzip")


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    if not Path(REGISTRY_BIN).exists():
        pytest.fail("docker-registry is needed: scripts/test installs it")
    root = tmp_path_factory.mktemp("build-errors")
    storage = root / "storage"
    started: list[Registry] = []
    srv: ServerProcess | None = None
    restore_env: Callable[[], None] = env_unchanged
    try:
        open_reg = Registry.start(root / "open", storage)
        started.append(open_reg)
        basic = Registry.start_basic(root / "basic", storage, USER, PASSWORD)
        started.append(basic)
        pusher = Pusher(open_reg.url)
        try:
            push_busybox(pusher)
            bb = busybox_layers()
            big = Layer().file("big.bin", os.urandom(24 * MIB)).blob("gzip")
            bad = Layer().file("corrupt-me", b"these bytes will be altered\n" * 64).blob("gzip")
            corrupt = pusher.image("corrupt", "1", [bb[0], big, bad])
            arm = pusher.image("armonly", "arm64", [bb[0]], arch="arm64", push_tag=False)
            pusher.index("armonly", "1", [(arm, "arm64")])
            pusher.image("bigdownload", "1", [bb[0], big])
            fill = _fill_layer()
            pusher.image("filltop", "1", [bb[0], fill])
            pusher.image("fillbottom", "1", [fill])
        finally:
            pusher.close()
        # Same size, one byte different: only the digest check can tell.
        data = blob_data_path(storage, corrupt.layer_digests[2])
        raw = bytearray(data.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        data.write_bytes(bytes(raw))
        home = prepare_home(root / "home")
        srv = ServerProcess(
            home, env={"AGENTENV_WARM_LOW": "0", "AGENTENV_WARM_HIGH": "0"}, ready_timeout_s=180
        ).start()
        restore_env = use_sdk_env(srv)
        yield Env(srv, open_reg, basic, storage, corrupt)
    finally:
        restore_env()
        print(f"build error numbers: {NUMBERS}")
        for name, message in REASONS.items():
            print(f"  {name}: {message}")
        if srv is not None:
            stop_and_check(srv)
        for reg in started:
            reg.stop()


def wait_done(info: Any) -> Any:
    deadline = time.monotonic() + BUILD_DEADLINE_S
    while time.monotonic() < deadline:
        status = Template.get_build_status(info, logs_offset=0)
        if status.status in (TemplateBuildStatus.READY, TemplateBuildStatus.ERROR):
            return status
        time.sleep(0.5)
    raise AssertionError(f"build {info.build_id} not finished after {BUILD_DEADLINE_S}s")


def failed(template: Any, name: str, step: str, match: str, *, sdk_raise: bool = True) -> Any:
    """Build `template` in the background, wait, check it failed at `step` with a message
    matching `match`; with `sdk_raise`, also check `Template.build` raises it."""
    t0 = time.monotonic()
    info = Template.build_in_background(template, name, cpu_count=1, memory_mb=512)
    status = wait_done(info)
    NUMBERS[f"{name}_s"] = round(time.monotonic() - t0, 2)
    assert status.status == TemplateBuildStatus.ERROR, status
    assert status.reason is not None, status
    assert status.reason.step == step, status.reason
    assert re.search(match, status.reason.message), status.reason.message
    REASONS[name] = status.reason.message
    if sdk_raise:
        with pytest.raises(BuildException, match=match):
            Template.build(template, name, cpu_count=1, memory_mb=512)
    return status


def _loop_backings() -> list[str]:
    out = subprocess.run(
        ["losetup", "--list", "--noheadings", "-O", "BACK-FILE"],
        capture_output=True, text=True, timeout=30, check=False,
    ).stdout  # fmt: skip
    return [line.strip() for line in out.splitlines() if line.strip()]


def _processes_naming(needle: str, exe: str) -> list[str]:
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if exe in cmd and needle in cmd:
            found.append(f"{pid} {cmd[:120]}")
    return found


def orphan_layers(home: Path) -> list[str]:
    """Layers in the store that nothing holds, directly or as a backing file."""
    store = LayerStore(home / "layers")
    protected: set[str] = set()
    for digest in store.digests():
        if store.holders(digest):
            protected.update(store.chain(digest))
    return sorted(set(store.digests()) - protected)


def assert_clean(env: Env, *, allow_mounts: tuple[Path, ...] = ()) -> None:
    home = env.server.home
    with httpx.Client(
        base_url=env.server.url,
        headers={"X-API-Key": env.server.api_key},
        timeout=REQUEST_TIMEOUT_S,
    ) as c:
        assert c.get("/v2/sandboxes").json() == []
    assert not qemu_processes(home, warm=True, converters=True)
    sandboxes = home / "sandboxes"
    assert not (sandboxes.is_dir() and os.listdir(sandboxes)), os.listdir(sandboxes)
    oci = home / "oci"
    scratch = oci / "tmp"
    assert not (scratch.is_dir() and os.listdir(scratch)), os.listdir(scratch)
    partials = list((oci / "blobs" / "sha256").glob("*.partial")) if oci.is_dir() else []
    assert partials == []
    assert not [b for b in _loop_backings() if str(home) in b]
    assert not _processes_naming(str(home), "qemu-storage-daemon")
    mounts = [
        line.split()[4]
        for line in Path("/proc/self/mountinfo").read_text().splitlines()
        if str(home) in line.split()[4]
    ]
    assert sorted(mounts) == sorted(str(p) for p in allow_mounts), mounts
    assert orphan_layers(home) == []
    snaps = home / "snapshots"
    assert not list(snaps.glob(f"{_STAGING_PREFIX}*")) if snaps.is_dir() else True


# -- pulls that fail: no VM ----------------------------------------------------------------


def test_unknown_image(env: Env) -> None:
    ref = f"{env.open.host}/no-such-image:1"
    failed(Template().from_image(ref), "unknown-image", "base", r"no-such-image.*manifest unknown")
    assert_clean(env)


def test_unknown_tag(env: Env) -> None:
    ref = f"{env.open.host}/busybox:no-such-tag"
    failed(Template().from_image(ref), "unknown-tag", "base", r"busybox:no-such-tag.*unknown")
    assert_clean(env)


def test_wrong_basic_credentials(env: Env) -> None:
    ref = f"{env.basic.host}/busybox:1"
    t = Template().from_image(ref, username=USER, password="not-the-password")
    failed(t, "wrong-creds", "base", rf"refused access as '{USER}'")
    # No credentials at all: refused too, and said so.
    failed(Template().from_image(ref), "no-creds", "base", "wants a username and password")
    assert_clean(env)


def test_corrupted_blob(env: Env) -> None:
    ref = f"{env.open.host}/corrupt:1"
    failed(Template().from_image(ref), "corrupt", "base", r"the data received hashes to sha256:")
    blobs = env.server.home / "oci" / "blobs" / "sha256"
    bad = env.corrupt.layer_digests[2].split(":", 1)[1]
    assert not (blobs / bad).exists() and not (blobs / f"{bad}.partial").exists()
    assert_clean(env)


def test_index_without_linux_amd64(env: Env) -> None:
    ref = f"{env.open.host}/armonly:1"
    failed(Template().from_image(ref), "armonly", "base", r"linux/amd64.*linux/arm64")
    assert_clean(env)


# -- the host disk fills up during a pull or a block layer build: no VM ------------------------


@contextlib.contextmanager
def small_tmpfs(path: Path, size_mb: int) -> Iterator[Path]:
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_mb}m,mode=0755", "tmpfs", str(path)],
        check=True, timeout=30,
    )  # fmt: skip
    try:
        yield path
    finally:
        # Not lazy: a file the server still holds open there would make this fail.
        done = subprocess.run(["umount", str(path)], capture_output=True, text=True, timeout=30)
        if done.returncode != 0:
            subprocess.run(["umount", "-l", str(path)], timeout=30, check=False)
            raise AssertionError(f"umount {path}: {done.stderr.strip()} (something holds it)")


def test_host_disk_full_during_download(env: Env) -> None:
    blobs = env.server.home / "oci" / "blobs" / "sha256"
    with small_tmpfs(blobs, 8):
        failed(
            Template().from_image(f"{env.open.host}/bigdownload:1"),
            "full-download",
            "base",
            r"No space left on device",
            sdk_raise=False,
        )
        left = {p.name for p in blobs.iterdir()}
        assert not [n for n in left if n.endswith(".partial") or n.startswith(".")], left
        assert_clean(env, allow_mounts=(blobs,))
    assert_clean(env)


def test_host_disk_full_during_block_layer_build(env: Env) -> None:
    scratch = env.server.home / "oci" / "tmp"
    with small_tmpfs(scratch, 48):
        # Over an existing bottom layer: the overlay written through qemu-storage-daemon.
        failed(
            Template().from_image(f"{env.open.host}/filltop:1"),
            "full-overlay",
            "base",
            r"is full \(\d+ MB free\)",
            sdk_raise=False,
        )
        assert_clean(env, allow_mounts=(scratch,))
        # A bottom layer: mkfs, loop mount, qemu-img convert, all in the scratch dir.
        failed(
            Template().from_image(f"{env.open.host}/fillbottom:1"),
            "full-bottom",
            "base",
            r"is full \(\d+ MB free\)|No space left on device",
            sdk_raise=False,
        )
        assert_clean(env, allow_mounts=(scratch,))
    assert_clean(env)
    with httpx.Client(timeout=REQUEST_TIMEOUT_S) as c:
        assert c.get(f"{env.server.url}/health").status_code == 200


# -- steps that fail in the build sandbox: one VM each -------------------------------------


def _build_snapshots(home: Path) -> list[str]:
    """Names of step cache and final snapshots (a failed first step makes none)."""
    repo = SnapshotRepository(home / "snapshots", LayerStore(home / "layers"))
    return sorted(n for s in repo.list() for n in s.names if n.startswith("build-"))


def test_run_step_exits_1(env: Env) -> None:
    before = _build_snapshots(env.server.home)
    t = (
        Template()
        .from_image(f"{env.open.host}/busybox:1")
        .run_cmd("echo the-output-before-the-failure; echo on-stderr >&2; exit 1", user="root")
    )
    status = failed(t, "run-fails", "1", r"exit code 1", sdk_raise=False)
    tail = [e.message for e in status.reason.log_entries]
    assert "the-output-before-the-failure" in tail and "on-stderr" in tail, tail
    assert _build_snapshots(env.server.home) == before
    assert_clean(env)


def test_build_sandbox_disk_fills_up(env: Env) -> None:
    """`dd` until the guest's disk is full: the step fails (not a hang), the server lives."""
    before = _build_snapshots(env.server.home)
    t = (
        Template()
        .from_image(f"{env.open.host}/busybox:1")
        .run_cmd("dd if=/dev/zero of=/fill bs=1M; r=$?; df -m /; exit $r", user="root")
    )
    status = failed(t, "disk-fills", "1", r"exit code 1", sdk_raise=False)
    tail = " ".join(e.message for e in status.reason.log_entries)
    assert "No space left on device" in tail, tail
    assert _build_snapshots(env.server.home) == before
    assert_clean(env)
