"""Shared fixtures: per-session state dir on the shared artifact cache, and the leak checks.

The per-test leak check runs around tests that touch host resources in this process (marked
`vm` or `host`, or using the session's data dir): it records which host resources made by
this test process exist before the test and fails the test if new ones are still there
afterwards: QEMU processes, network namespaces, slot links, mounts, sandbox cgroups and files
under the sandboxes dir. The run-end check (`pytest_sessionfinish`) judges what subprocess
servers and agents left, by owner. Every test also fails if it removed a big file on an
event loop (`loopguard`).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from loopguard import guard_unlinks
from resolver import TestResolver

from agentenv.config import Settings
from agentenv.template.datadir import SEED_ENV
from agentenv.vmm import cgroup

# This process loads gRPC (the etcd client) and also forks children onto PTYs (envd's process
# table under test): with gRPC's fork handlers on, they log into the child's terminal, which
# the child's output then starts with. Read when gRPC is first imported, after this module.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

# What this run's resources were when it started (`pytest_sessionstart`, controller only).
_BEFORE = pytest.StashKey[tuple[set[str], bool]]()


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


# Temp dirs that fixtures wider than a module make in a worker's basetemp (the session data
# dir, the OCI registries, a package's etcd): they outlive the module that first asked.
_WIDER_THAN_A_MODULE = ("agentenv-home", "registries", "etcd")


@pytest.fixture(scope="module", autouse=True)
def module_temp_dirs(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[None]:
    """What a module's fixtures made in the temp dir (data dirs with VM disks and RAM files,
    built images) goes when the module ends, unless one of its tests failed: a run's peak
    disk is then one module's, not the sum of all."""
    base = tmp_path_factory.getbasetemp()
    before = set(os.listdir(base))
    failed = request.session.testsfailed
    yield
    if request.session.testsfailed != failed:
        return
    for name in set(os.listdir(base)) - before:
        if not name.startswith(_WIDER_THAN_A_MODULE):
            shutil.rmtree(base / name, ignore_errors=True)


def _snapshot(home: Path) -> dict[str, set[str]]:
    """Resources this process made that exist now. Other servers (and this run's other
    workers) share the host, so namespaces (and their links and mounts) count only if this
    process created them, and cgroups only if their names were created here. The host nft
    table is shared by every slot on the host: the run-end check judges it."""
    from agentenv.network import slot

    netns = set(os.listdir("/run/netns")) if os.path.isdir("/run/netns") else set()
    ours_ns = {n for n in netns if slot.made_here(n)}
    ours_links = {n.replace(slot.NETNS_PREFIX, slot.HOST_VETH_PREFIX, 1) for n in ours_ns}
    links = set(os.listdir("/sys/class/net"))
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
        "mounts": mounts,
        "cgroups": {str(p) for p in cgroup.stale() if p.name in cgroup.created_here},
        "sandbox files": files,
    }


def _touches_host(item: pytest.Item, fixturenames: list[str]) -> bool:
    return (
        item.get_closest_marker("vm") is not None
        or item.get_closest_marker("host") is not None
        or "agentenv_home" in fixturenames
    )


@pytest.fixture(autouse=True)
def no_big_unlink_on_a_loop(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    with guard_unlinks(monkeypatch) as seen:
        yield
    if seen:
        pytest.fail(f"big files removed on an event loop (use a thread): {seen}", pytrace=False)


@pytest.fixture(autouse=True)
def leak_check(request: pytest.FixtureRequest) -> Iterator[None]:
    if not _touches_host(request.node, request.fixturenames):
        yield
        return
    agentenv_home: Path = request.getfixturevalue("agentenv_home")
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


def _cgroup_is_foreign(path: Path, root: str) -> bool:
    """Whether a sandbox cgroup belongs to another server: a process in it whose command
    line does not name this run's temp root."""
    for procs in path.glob("**/cgroup.procs"):
        try:
            pids = procs.read_text().split()
        except OSError:
            continue
        for pid in pids:
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if root.encode() not in cmd:
                return True
    return False


def _run_resources(root: Path) -> set[str]:
    """What exists on the host now that belongs to this run: QEMU processes and mounts
    naming its temp root, the slots its data dirs mark as held (`network.slot` markers, and
    those this process made) with their links, and sandbox cgroups with no other server's
    process in them. The host nft table is judged apart (`_orphan_table`): it is shared."""
    from agentenv.network import slot
    from agentenv.vmm import registry

    mark = str(root)
    found = {f"qemu pid {pid} {cmd[:100]}" for pid, cmd in registry.qemu_processes(mark).items()}
    found |= {
        f"mount {line.split()[1]}"
        for line in Path("/proc/self/mounts").read_text().splitlines()
        if mark in line
    }
    netns = set(os.listdir("/run/netns")) if os.path.isdir("/run/netns") else set()
    marked = {m.name for m in root.glob("**/run/slots/ae-s*")}
    ours = {n for n in netns if n in marked or slot.made_here(n)}
    found |= {f"netns {n}" for n in ours}
    links = set(os.listdir("/sys/class/net"))
    found |= {
        f"link {link}"
        for n in ours
        if (link := n.replace(slot.NETNS_PREFIX, slot.HOST_VETH_PREFIX, 1)) in links
    }
    found |= {f"cgroup {p}" for p in cgroup.stale() if not _cgroup_is_foreign(p, mark)}
    return found


def _orphan_table() -> bool:
    """The host nft table exists with no slot link left on the host (whoever's)."""
    from agentenv.network import slot

    if any(n.startswith(slot.HOST_VETH_PREFIX) for n in os.listdir("/sys/class/net")):
        return False
    tables = subprocess.run(
        ["nft", "list", "tables"], capture_output=True, text=True, check=False
    ).stdout.splitlines()
    return any("agentenv" in t for t in tables)


def _controller(config: pytest.Config) -> bool:
    return not hasattr(config, "workerinput")


def _run_root(config: pytest.Config) -> Path:
    """The temp root of this run: under pytest-xdist every worker's basetemp lies inside the
    controller's, so the controller sees every home, slot marker and VM of the run."""
    base: Path = config._tmp_path_factory.getbasetemp()  # type: ignore[attr-defined]
    return base if _controller(config) else base.parent


@pytest.hookimpl(trylast=True)  # after the tmp_path plugin has set up its factory
def pytest_configure(config: pytest.Config) -> None:
    # Data dirs made by `prepare_home` start from one seed per run (its snapshot of `base`
    # is captured once, by whichever worker needs it first), not from a cold boot each.
    os.environ.setdefault(SEED_ENV, str(_run_root(config) / "seed-home"))
    # No warm pools unless a test asks for one (tests of the pool, of crash recovery with
    # it): a pool's refills are QEMUs started in the background of every other test.
    os.environ.setdefault("AGENTENV_WARM_LOW", "0")
    os.environ.setdefault("AGENTENV_WARM_HIGH", "0")


def pytest_sessionstart(session: pytest.Session) -> None:
    if _controller(session.config):
        session.config.stash[_BEFORE] = (_run_resources(_run_root(session.config)), _orphan_table())


# First: the tmp_path plugin removes a passed run's temp root (and the slot markers in it).
@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session: pytest.Session) -> None:
    """The per-test check only sees what a test's own process made; servers and node agents
    run as subprocesses and make their own slots and VMs. Once every worker is done, nothing
    this run made may remain, judged by owner (this run's temp root, its slot markers), so
    other servers on the host, and this run's own workers, never count."""
    config = session.config
    if not _controller(config) or _BEFORE not in config.stash:
        return
    before, table_before = config.stash[_BEFORE]
    root = _run_root(config)
    left = _run_resources(root) - before
    if left:
        # A teardown of another server racing its own cgroup: look once more.
        time.sleep(1.0)
        left &= _run_resources(root)
    if _orphan_table() and not table_before:
        left.add("nft table inet agentenv with no slot left")
    if left:
        reporter = config.pluginmanager.get_plugin("terminalreporter")
        message = f"the test session left resources behind: {sorted(left)}"
        if reporter is not None:
            reporter.write_line(message, red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


# -- parallel runs and the cost of each module ------------------------------------------------

# Measured wall seconds per module (setup, call and teardown of its tests; `--module-times`
# writes a new table). Modules run longest first, so the last one a worker starts is short.
MODULE_TIMES = Path(__file__).with_name("module_times.json")
# A module not in the table yet is taken to be this long: new modules start early.
UNKNOWN_MODULE_S = 120.0


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--module-times",
        metavar="PATH",
        help="write each module's measured wall seconds to PATH (the format of "
        "tests/module_times.json)",
    )


def _module_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The longest modules first (`scripts/test` runs with `--dist loadfile`, so a module runs
    whole on one worker and its module-scoped servers are made once). Every worker sorts the
    same way, so their collections agree."""
    known: dict[str, float] = json.loads(MODULE_TIMES.read_text()) if MODULE_TIMES.exists() else {}
    order = {m: i for i, m in enumerate(dict.fromkeys(_module_of(i.nodeid) for i in items))}

    def cost(item: pytest.Item) -> tuple[float, int]:
        module = _module_of(item.nodeid)
        return (-known.get(module, UNKNOWN_MODULE_S), order[module])

    items.sort(key=cost)


# Seconds per module of this run, from every phase's report (under xdist the controller gets
# the workers' reports, with their durations).
_module_seconds: dict[str, float] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    module = _module_of(report.nodeid)
    _module_seconds[module] = _module_seconds.get(module, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    """Wall seconds per module, the 25 longest, after the slowest tests (`--durations`): what
    each module costs stays visible run after run."""
    if not _controller(config) or not _module_seconds:
        return
    ranked = sorted(_module_seconds.items(), key=lambda kv: -kv[1])
    terminalreporter.write_sep("=", f"slowest modules (of {len(ranked)}; seconds, all phases)")
    for module, seconds in ranked[:25]:
        terminalreporter.write_line(f"{seconds:8.1f}  {module}")
    terminalreporter.write_line(f"{sum(_module_seconds.values()):8.1f}  total")
    path = config.getoption("module_times")
    if path:
        Path(path).write_text(
            json.dumps({m: round(s, 1) for m, s in sorted(_module_seconds.items())}, indent=1)
            + "\n"
        )
