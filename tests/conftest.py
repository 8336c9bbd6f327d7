"""Shared fixtures: per-session state dir on the shared artifact cache, and the leak check.

The leak check runs around every test. It records which host resources made by this test
process exist before the test and fails the test if new ones are still there afterwards: QEMU
processes, network namespaces, slot links, the host nftables table (once no slot is left),
mounts, sandbox cgroups and files under the sandboxes dir.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from resolver import TestResolver

from agentenv.config import Settings
from agentenv.vmm import cgroup


@pytest.fixture(scope="session", autouse=True)
def test_resolver() -> Iterator[TestResolver]:
    """Every guest's DNS goes to the node's forwarder, and the forwarder's upstream is this
    resolver (servers started as subprocesses inherit the variable): a guest's lookup never
    reaches the host's resolver. Tests add the names they need (`.set`)."""
    saved = os.environ.get("AGENTENV_DNS")
    with TestResolver() as resolver:
        os.environ["AGENTENV_DNS"] = resolver.address
        try:
            yield resolver
        finally:
            if saved is None:
                os.environ.pop("AGENTENV_DNS", None)
            else:
                os.environ["AGENTENV_DNS"] = saved


@pytest.fixture(scope="session")
def agentenv_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("agentenv-home")


@pytest.fixture
def settings(agentenv_home: Path, monkeypatch: pytest.MonkeyPatch) -> Settings:
    monkeypatch.setenv("AGENTENV_HOME", str(agentenv_home))
    return replace(Settings.from_env(), home=agentenv_home)


def _descendant_qemus(home: Path) -> set[str]:
    """QEMU processes that are ours: children of this process or using our state dir."""
    me = os.getpid()
    found: set[str] = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if "qemu-system" not in cmd:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == me or str(home) in cmd:
            found.add(f"{entry} {cmd[:120]}")
    return found


def _snapshot(home: Path) -> dict[str, set[str]]:
    """Resources this process made that exist now. Other engineers' servers share the host,
    so namespaces (and their links and mounts) count only if this process created them, and
    cgroups only if their names were created here."""
    from agentenv.network import slot

    netns = set(os.listdir("/run/netns")) if os.path.isdir("/run/netns") else set()
    ours_ns = {n for n in netns if slot.made_here(n)}
    ours_links = {n.replace(slot.NETNS_PREFIX, slot.HOST_VETH_PREFIX, 1) for n in ours_ns}
    links = set(os.listdir("/sys/class/net"))
    host_veths = {n for n in links if n.startswith(slot.HOST_VETH_PREFIX)}
    tables = subprocess.run(
        ["nft", "list", "tables"], capture_output=True, text=True, check=False
    ).stdout.splitlines()
    mounts = {
        line.split()[1]
        for line in Path("/proc/self/mounts").read_text().splitlines()
        if str(home) in line or any(f"/run/netns/{n} " in line + " " for n in ours_ns)
    }
    sandboxes = home / "sandboxes"
    files = {str(p) for p in sandboxes.rglob("*")} if sandboxes.is_dir() else set()
    return {
        "qemu processes": _descendant_qemus(home),
        "network namespaces": netns & ours_ns,
        "links": links & ours_links,
        # The host table must go with the last slot, whoever owned it.
        "nft tables": {t for t in tables if "agentenv" in t} if not host_veths else set(),
        "mounts": mounts,
        "cgroups": {str(p) for p in cgroup.stale() if p.name in cgroup.created_here},
        "sandbox files": files,
    }


@pytest.fixture(autouse=True)
def leak_check(agentenv_home: Path) -> Iterator[None]:
    before = _snapshot(agentenv_home)
    yield
    after = _snapshot(agentenv_home)
    leaks = {k: sorted(after[k] - before[k]) for k in after if after[k] - before[k]}
    if leaks:
        pytest.fail(f"test left resources behind: {leaks}", pytrace=False)


@pytest.fixture(scope="session")
def guest_artifacts() -> object:
    """Kernel, initramfs and tools layer from the shared cache (built once if missing)."""
    from agentenv.template.artifacts import ensure_all

    return ensure_all(Settings.from_env(), None)


@pytest.fixture(scope="session")
def base_template(agentenv_home: Path) -> object:
    """The `base` template registered in this session's data dir (rootfs from the cache)."""
    from agentenv.template.rootfs import ensure_base

    return ensure_base(replace(Settings.from_env(), home=agentenv_home), None)


def _host_wide() -> set[str]:
    """Every agentenv resource on the host, whoever made it: namespaces, slot links, the
    nftables table, sandbox cgroups and QEMU processes."""
    from agentenv.network import slot

    found: set[str] = set()
    if os.path.isdir("/run/netns"):
        found |= {f"netns {n}" for n in os.listdir("/run/netns") if n.startswith("ae-")}
    found |= {
        f"link {n}" for n in os.listdir("/sys/class/net") if n.startswith(slot.HOST_VETH_PREFIX)
    }
    tables = subprocess.run(
        ["nft", "list", "tables"], capture_output=True, text=True, check=False
    ).stdout.splitlines()
    found |= {f"nft {t}" for t in tables if "agentenv" in t}
    found |= {f"cgroup {p}" for p in cgroup.stale()}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmd = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")[0]
            except OSError:
                continue
            if b"qemu-system" in cmd:
                found.add(f"qemu pid {entry}")
    return found


@pytest.fixture(scope="session", autouse=True)
def no_leaks_at_session_end() -> Iterator[None]:
    """The per-test check only sees what this process made; servers run as subprocesses make
    their own slots and VMs. At the end of the session nothing new may remain on the host."""
    before = _host_wide()
    yield
    left = sorted(_host_wide() - before)
    if left:
        pytest.fail(f"the test session left resources behind: {left}", pytrace=False)
