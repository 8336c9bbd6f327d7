"""The guest init as PID 1 of fresh namespaces, chrooted into a root holding only the tools.

It runs the real init and the real envd; namespaces (pid, mount, uts, net, cgroup) keep every
mount, the hostname and envd's port away from the host.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from agentenv.config import Settings
from agentenv.guest import init as guest_init
from agentenv.guest.init import (
    START_BUDGET_S,
    Supervisor,
    ext4_size,
    parse_cmdline,
    run_start_hooks,
    start_budget,
)
from agentenv.template import tools

UNIFIED = Path("/sys/fs/cgroup/unified")


def test_parse_cmdline_takes_only_agentenv_keys() -> None:
    opts = parse_cmdline(
        "console=ttyS0 agentenv.ip=169.254.0.2/30 agentenv.gw=169.254.0.1 ip=dhcp "
        "agentenv.hostname=sb-1 agentenv.broken\n"
    )
    assert opts == {"ip": "169.254.0.2/30", "gw": "169.254.0.1", "hostname": "sb-1"}


def test_the_start_budget_comes_from_the_command_line_and_falls_back_on_bad_values() -> None:
    assert start_budget(parse_cmdline("agentenv.start_budget=270")) == 270.0
    for bad in (
        "",
        "agentenv.start_budget=soon",
        "agentenv.start_budget=-5",
        "agentenv.start_budget=nan",
        "agentenv.start_budget=inf",
    ):
        assert start_budget(parse_cmdline(bad)) == START_BUDGET_S, bad


def test_ext4_size_reads_the_superblock(tmp_path: Path) -> None:
    image = tmp_path / "fs.ext4"
    subprocess.run(["mkfs.ext4", "-q", "-F", str(image), "80M"], check=True)
    assert ext4_size(str(image)) == 80 << 20
    with image.open("r+b") as fh:
        fh.truncate(200 << 20)  # a bigger disk under the same filesystem
    assert ext4_size(str(image)) == 80 << 20
    (tmp_path / "zero").write_bytes(b"\0" * 4096)
    assert ext4_size(str(tmp_path / "zero")) == 0


def _hook(directory: Path, name: str, body: str, mode: int = 0o755) -> Path:
    path = directory / name
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(mode)
    return path


def test_start_hooks_run_in_order_with_logs_and_a_shared_budget(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    hooks, logs, trace = tmp_path / "start.d", tmp_path / "logs", tmp_path / "trace"
    hooks.mkdir()
    monkeypatch.setattr(guest_init, "LOG_DIR", logs)
    _hook(hooks, "20-second", f"echo second >> {trace}; echo to-log; exit 3")
    _hook(hooks, "10-first", f"echo first >> {trace}")
    _hook(hooks, "30-slow", f"echo slow >> {trace}; exec sleep 30")
    _hook(hooks, "40-late", f"echo late >> {trace}")
    _hook(hooks, "15-not-executable", f"echo never >> {trace}", mode=0o644)
    started = time.monotonic()
    run_start_hooks(hooks, budget_s=3.0)
    # The slow hook used up the budget: it was stopped there and the next one skipped.
    assert 2.5 < time.monotonic() - started < 10
    assert trace.read_text().split() == ["first", "second", "slow"]
    assert (logs / "start-20-second.log").read_text() == "to-log\n"
    console = capfd.readouterr().out
    assert "start hook 10-first: ok" in console
    assert "start hook 20-second: exit 3" in console
    assert "start hook 30-slow: timed out" in console
    assert "start hook 40-late: skipped" in console
    # What a template's build reads before its capture: every hook that did not end well.
    failed = (logs / guest_init.START_FAILED.name).read_text().splitlines()
    assert [line.split(":")[0] for line in failed] == ["20-second", "30-slow", "40-late"]
    assert failed[0].startswith("20-second: exit 3 after ")


def test_start_hooks_without_a_directory_do_nothing(tmp_path: Path) -> None:
    run_start_hooks(tmp_path / "absent", budget_s=1.0)  # must not raise


def test_start_hooks_that_all_end_well_leave_no_failure_record(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hooks, logs = tmp_path / "start.d", tmp_path / "logs"
    hooks.mkdir()
    monkeypatch.setattr(guest_init, "LOG_DIR", logs)
    _hook(hooks, "10-fine", "true")
    run_start_hooks(hooks, budget_s=5.0)
    assert (logs / "start-10-fine.log").exists()
    assert not (logs / guest_init.START_FAILED.name).exists()


def test_init_refuses_to_run_outside_pid_1() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "agentenv.guest.init"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 1
    assert "must run as PID 1" in proc.stderr


def test_supervisor_restarts_a_dying_service_with_backoff(tmp_path: Path) -> None:
    sup = Supervisor(["/bin/sh", "-c", "echo tick"])
    sup.log_path = tmp_path / "envd.log"
    sup.start()
    first = sup.pid
    deadline = time.monotonic() + 10
    while sup.pid is not None and time.monotonic() < deadline:
        time.sleep(0.05)
        try:
            pid, status = os.waitpid(first or -1, os.WNOHANG)
        except ChildProcessError:
            break
        if pid:
            sup.exited(status)
    assert sup.pid is None
    assert sup.restart_at > time.monotonic() - 0.05
    assert sup.backoff == pytest.approx(0.4)
    deadline = time.monotonic() + 5
    while "tick" not in sup.log_path.read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sup.log_path.read_text().strip() == "tick"


@pytest.fixture
def chroot_root(settings: Settings, tmp_path: Path) -> Path:
    root = tmp_path / "root"
    tools.populate_tree(
        root / ".agentenv", tools.ensure_runtime(settings), tools.ensure_pydeps(settings)
    )
    (root / "etc").mkdir()
    (root / "etc" / "hostname").write_text("init-test\n")
    (root / "etc" / "group").write_text("root:x:0:\ntty:x:5:\n")
    for d in ("proc", "sys", "dev", "run", "tmp", "bin"):
        (root / d).mkdir(exist_ok=True)
    return root


@pytest.fixture
def cgroup_dir() -> Iterator[Path]:
    if not UNIFIED.is_dir():
        pytest.skip("no cgroup2 hierarchy at /sys/fs/cgroup/unified to confine the test in")
    path = UNIFIED / f"agentenv-init-test-{os.getpid()}"
    path.mkdir()
    try:
        yield path
    finally:
        # Whatever the test left running in the namespace goes with the cgroup.
        (path / "cgroup.kill").write_text("1")
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                path.rmdir()
                break
            except OSError:
                time.sleep(0.1)


def _read_until(
    proc: subprocess.Popen[bytes], needle: bytes, seen: bytearray, timeout: float
) -> None:
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    while seen.count(needle) == 0 and time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 0.2)
        if ready:
            chunk = os.read(proc.stdout.fileno(), 65536)
            if not chunk:
                break
            seen += chunk
    assert needle in seen, seen.decode(errors="replace")


def _children(pid: int) -> list[int]:
    text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    return [int(x) for x in text.split()]


def test_init_as_pid1_mounts_starts_restarts_and_shuts_down(
    chroot_root: Path, cgroup_dir: Path
) -> None:
    # The shell joins the test cgroup first, so init's cgroup writes stay inside it.
    script = (
        f"echo $$ > {cgroup_dir}/cgroup.procs && exec unshare --pid --fork --mount --uts "
        f"--net --cgroup --propagation private chroot {chroot_root} "
        "/.agentenv/bin/python -m agentenv.guest.init"
    )
    proc = subprocess.Popen(
        ["/bin/sh", "-c", script], stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    seen = bytearray()
    try:
        _read_until(proc, b"agentenv: envd started", seen, 60)
        # unshare --fork: our child is unshare, its child is the namespace's PID 1.
        init_pid = _children(proc.pid)[0]
        status = Path(f"/proc/{init_pid}/status").read_text().splitlines()
        ns_pids = next(line for line in status if line.startswith("NSpid:")).split()[1:]
        assert ns_pids[-1] == "1"  # PID 1 inside its namespace
        mounts = {
            line.split()[1]: line.split()[2]
            for line in Path(f"/proc/{init_pid}/mounts").read_text().splitlines()
        }
        for target, fstype in (
            ("/proc", "proc"),
            ("/dev/pts", "devpts"),
            ("/dev/shm", "tmpfs"),
            ("/run", "tmpfs"),
            ("/tmp", "tmpfs"),
            ("/sys/fs/cgroup", "cgroup2"),
        ):
            assert mounts.get(target) == fstype, (target, mounts)
        hostname = subprocess.run(
            ["nsenter", "-t", str(init_pid), "-u", "hostname"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        assert hostname == "init-test"

        envd_pid = _children(init_pid)[0]
        os.kill(envd_pid, signal.SIGKILL)
        _read_until(proc, b"envd exited (signal 9)", seen, 30)
        _read_until(proc, b"agentenv: envd started", seen[seen.index(b"envd exited") :], 30)

        os.kill(init_pid, signal.SIGTERM)
        _read_until(proc, b"SIGTERM: stopping", seen, 30)
        # reboot(2) from a PID namespace's init ends the namespace instead of the machine.
        proc.wait(timeout=30)
        assert not Path(f"/proc/{init_pid}").exists()
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
