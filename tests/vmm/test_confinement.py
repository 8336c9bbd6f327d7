"""Confined QEMUs (`vmm.confine`), checked from the host: the uid it runs as, its seccomp
mode, what its root holds, that it cannot open a host file outside it, and that snapshots
(device state and RAM streams, now passed as descriptors) still save and load.

The first tests run the launch with a shell instead of QEMU (no VM); the rest boot QEMU."""

from __future__ import annotations

import os
import select
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest

from agentenv.config import Settings
from agentenv.storage import create_upper_sync
from agentenv.vmm import confine, launch
from agentenv.vmm.base import Drive, MachineSpec, VMStatus
from agentenv.vmm.errors import VMMError, VMStartError
from agentenv.vmm.qemu import QemuVM
from agentenv.vmm.ramshim import ensure_ram_shim

from .test_qemu import make_vm, run, wait_for

MIB = 1024 * 1024
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="the launch needs root")


def test_uids_are_per_slot_and_apart_from_login_users() -> None:
    assert confine.vm_ids("a", "ae-s0") == (confine.SLOT_UID_BASE, confine.SLOT_UID_BASE)
    assert confine.vm_ids("b", "ae-s7")[0] == confine.SLOT_UID_BASE + 7
    # Without a slot: from the name, in a range no slot uses, the same every time.
    uid, gid = confine.vm_ids("sbx-cv", None)
    assert uid == gid == confine.vm_ids("sbx-cv", None)[0]
    assert confine.SLOTLESS_UID_BASE <= uid < confine.SLOTLESS_UID_BASE + confine.SLOTLESS_UIDS
    assert confine.vm_ids("x", "other-ns")[0] >= confine.SLOTLESS_UID_BASE


def test_backing_chain_is_read_from_the_headers(tmp_path: Path) -> None:
    base = tmp_path / "layers" / "base.qcow2"
    base.parent.mkdir()
    assert run("qemu-img", "create", "-q", "-f", "qcow2", base, "16M").returncode == 0
    mid, top = tmp_path / "mid.qcow2", tmp_path / "w" / "top.qcow2"
    top.parent.mkdir()
    create_upper_sync(base, mid)
    create_upper_sync(mid, top)
    assert confine.backing_chain(top) == [mid, base]
    assert confine.backing_chain(base) == []
    raw = tmp_path / "raw.img"
    raw.write_bytes(b"\0" * 4096)
    assert confine.backing_chain(raw) == []


def _launch_shell(jail: confine.Jail | None, script: str) -> tuple[int | None, str]:
    """`script` run by the launcher as QEMU would be (in `jail`); its status and output."""
    plan = {
        "argv": ["/bin/sh", "-c", script],
        "env": {},
        "cgroup_procs": [],
        "netns": None,
        "new_net": False,
        "pid_ns": jail is not None and confine.pid_namespaces(),
        "jail": None if jail is None else jail.plan(),
    }
    launcher = launch.shared()
    r, w = os.pipe()
    try:
        pid, pidfd = launcher.launch(plan, w, w)
    finally:
        os.close(w)
    os.close(pidfd)
    with os.fdopen(r) as f:
        out = f.read()
    return launcher.exit_status(pid, 30.0), out


@needs_root
def test_the_launch_gives_a_process_only_its_root(tmp_path: Path) -> None:
    """The same launch QEMU gets, with a shell in QEMU's place."""
    work, other = tmp_path / "work", tmp_path / "other"
    work.mkdir()
    other.mkdir()
    ro = other / "layer"
    ro.write_text("layer\n")
    secret = other / "secret"
    secret.write_text("host only")
    os.chmod(secret, 0o644)
    uid, gid = confine.vm_ids("launch-test", None)
    confine.prepare_host()
    confine.own_dir(work, gid)
    jail = confine.Jail(
        uid, gid, rw_dirs=[work], ro_files=[ro], programs=("sh", "id", "cat", "ls", "rm")
    )
    probe = (
        f"id -u; id -g; cat {ro}; echo new > {work}/made; "
        f"(echo x > {ro}) 2>/dev/null && echo ro-writable; "
        f"cat {secret} 2>/dev/null && echo secret-readable; "
        f"ls / /dev; ls {other}; rm -f {work}/server 2>/dev/null || echo cannot-remove"
    )
    (work / "server").write_text("the server's")
    code, out = _launch_shell(jail, probe)
    assert code == 0, out
    lines = out.split()
    assert lines[:3] == [str(uid), str(gid), "layer"]
    assert "ro-writable" not in lines and "secret-readable" not in lines
    assert "cannot-remove" in lines and (work / "server").exists()
    assert (work / "made").stat().st_uid == uid
    # Its root: the system tree, its devices, the path to its own files, nothing else.
    assert {"usr", "dev", "tmp"} <= set(lines)
    assert not {"etc", "root", "home", "proc", "secret"} & set(lines)
    assert {"null", "urandom"} <= set(lines) and "kvm" not in lines
    # Nothing of the launch is left on the host.
    assert str(confine.JAIL_DIR) not in Path("/proc/self/mounts").read_text()


@needs_root
def test_a_launch_spawns_one_process_and_a_dead_launcher_is_replaced() -> None:
    """The launcher forks one child per launch, which execs the program itself: the shell
    that runs is the launcher's child, PID 1 of its own namespace, and what it reports
    is its own exec (no wrapper in between). A launcher killed is noticed and replaced."""
    launcher = launch.shared()
    code, out = _launch_shell(None, "echo $PPID; ls /proc/$$/fd")
    # Its parent is the launcher; it holds stdin, stdout and stderr, nothing of the
    # launcher's (least of all its channel to the server).
    assert code == 0 and out.split() == [str(launcher.pid), "0", "1", "2"], out
    jail = confine.Jail(*confine.vm_ids("launch-test", None), programs=("sh",))
    code, out = _launch_shell(jail, "echo $$; exit 3")
    assert code == 3, out
    if confine.pid_namespaces():
        assert out.split() == ["1"]
    # Set-up failures come back as the launch's error, with the reason.
    bad = confine.Jail(0, 0, ro_files=[Path("/nonexistent/file")], programs=("sh",))
    with pytest.raises(VMStartError, match=r"launch failed.*nonexistent"):
        _launch_shell(bad, "true")
    old = launcher.pid
    assert old is not None
    pidfd = os.pidfd_open(old)
    os.kill(old, signal.SIGKILL)
    select.select([pidfd], [], [], 30.0)
    os.close(pidfd)
    code, out = _launch_shell(None, "echo $PPID")
    assert code == 0 and out.split() == [str(launcher.pid)] and launcher.pid != old


@pytest.mark.vm
def test_seccomp_is_on_qemus_command_line(settings: Settings, tmp_path: Path) -> None:
    from agentenv.vmm.accel import detect
    from agentenv.vmm.base import BootSource

    def argv(on: bool) -> list[str]:
        return QemuVM(
            name="argv",
            workdir=tmp_path,
            machine=MachineSpec(1, 128),
            boot=BootSource(tmp_path / "k", None, ""),
            drives=[],
            accel=detect(settings),
            confine=on,
        ).argv()

    on = argv(True)
    assert on[on.index("-sandbox") + 1] == confine.SANDBOX
    assert "spawn=deny" in confine.SANDBOX and "elevateprivileges=deny" in confine.SANDBOX
    assert "-sandbox" not in argv(False)


@pytest.mark.vm
async def test_a_missing_piece_fails_the_start(
    settings: Settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, guest_artifacts: Any
) -> None:
    vm = make_vm(settings, guest_artifacts, tmp_path / "vm")
    monkeypatch.setattr(confine, "TOOLS", ("no-such-command-here",))
    # A host found complete is not asked again in this process (`missing_once`); this one
    # stands for a host that never was.
    monkeypatch.setattr(confine, "_COMPLETE", set())
    with pytest.raises(VMStartError, match=r"no-such-command-here.*AGENTENV_CONFINE=off"):
        await vm.start()
    assert not (tmp_path / "vm").exists()


# -- with QEMU ------------------------------------------------------------------------------


def _status(pid: int) -> dict[str, str]:
    out: dict[str, str] = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        out[key] = value.strip()
    return out


def _files_in_root(pid: int, *, usr: bool = False) -> set[str]:
    """Every non-directory in the process's root, as paths inside it (/usr left out unless
    `usr`)."""
    root = Path(f"/proc/{pid}/root")
    found: set[str] = set()
    for dirpath, dirnames, filenames in os.walk(root):
        rel = "/" + os.path.relpath(dirpath, root)
        if rel == "/.":
            dirnames[:] = [d for d in dirnames if usr or d != "usr"]
            rel = ""
        found.update(f"{rel}/{f}" for f in filenames)
        found.update(f"{rel}/{d}" for d in dirnames if os.path.islink(os.path.join(dirpath, d)))
    return found


def _ram_open_modes(pid: int, ram: Path) -> set[int]:
    """Access modes of the descriptors `pid` holds on `ram` (which it must also map)."""
    assert str(ram) in Path(f"/proc/{pid}/maps").read_text()
    modes: set[int] = set()
    # Seen from the host, a file of its root is named under the root's mount point.
    names = (str(ram), str(confine.JAIL_DIR) + str(ram))
    for f in Path(f"/proc/{pid}/fd").iterdir():
        if os.readlink(f) in names:
            flags = Path(f"/proc/{pid}/fdinfo/{f.name}").read_text().split()[3]
            modes.add(int(flags, 8) & os.O_ACCMODE)
    return modes


def _comm(pid: str) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:  # gone meanwhile
        return ""


def _check_confined(vm: QemuVM, own_files: set[str]) -> None:
    assert vm.pid is not None
    status = _status(vm.pid)
    uids = status["Uid"].split()
    assert uids == [str(vm.uid)] * 4 and vm.uid != 0
    assert status["Gid"].split() == [str(vm.gid)] * 4
    assert status["Seccomp"] == "2"
    assert status["NoNewPrivs"] == "1"
    assert int(status["CapEff"], 16) == 0 and int(status["CapPrm"], 16) == 0
    # Under TCG no transparent huge pages (the translation buffer fills 4 KiB at a time).
    if vm.accel.name == "tcg":
        assert status["THP_enabled"] == "0"
    # Started with one fork and one exec: the launcher's child, with nothing in between,
    # and no program of the old launch chain is a child of ours. (Other children are other
    # tests' on a suite worker: a registry, a server of a module still running.)
    launcher = launch.shared()
    assert status["PPid"] == str(launcher.pid)
    me = os.getpid()
    kids = Path(f"/proc/{me}/task/{me}/children").read_text().split()
    assert str(launcher.pid) in kids
    chain = {"sh", "unshare", "nsenter", "chroot", "env", "qemu-system-x86"}
    assert not {_comm(k) for k in kids} & chain, kids
    # PID 1 of a PID namespace of its own: it sees no other process of the host.
    if confine.pid_namespaces():
        assert status["NSpid"].split() == [str(vm.pid), "1"]
        assert os.stat(f"/proc/{vm.pid}/ns/pid").st_ino != os.stat("/proc/self/ns/pid").st_ino
    files = _files_in_root(vm.pid)
    system = {"/bin", "/sbin", "/lib", "/lib64", "/lib32", "/libx32"}
    devices = {"/dev/null", "/dev/zero", "/dev/urandom", "/dev/random", "/dev/net/tun"}
    assert files - system - devices == own_files
    # Of the host's /usr: QEMU, `env`, the shared objects they load, QEMU's firmware and
    # modules. No shell, interpreter or tool to use after an escape.
    usr = {f for f in _files_in_root(vm.pid, usr=True) if f.startswith("/usr/")}
    view = confine.system_view((vm.qemu_binary, *confine.QEMU_HELPERS))
    allowed = {str(f) for f in view.files}
    outside = {f for f in usr - allowed if not any(Path(f).is_relative_to(d) for d in view.dirs)}
    assert not outside, sorted(outside)[:20]
    assert not {f for f in usr if ".so" not in f and "/qemu" not in f} - {"/usr/bin/env"}
    for tool in ("/usr/bin/sh", "/usr/bin/bash", "/usr/bin/python3", "/usr/bin/cat"):
        assert tool not in usr
    assert len(usr) < 400, len(usr)


@pytest.mark.vm
async def test_a_confined_guest_and_its_root(
    settings: Settings, guest_artifacts: Any, tmp_path: Path
) -> None:
    base = tmp_path / "layers" / "base.qcow2"
    base.parent.mkdir()
    assert run("qemu-img", "create", "-q", "-f", "qcow2", base, "32M").returncode == 0
    work = tmp_path / "vm"
    work.mkdir()
    upper = work / "rootfs.qcow2"
    create_upper_sync(base, upper)
    outside = tmp_path / "host-only.raw"
    outside.write_bytes(b"\0" * 65536)
    vm = make_vm(
        settings,
        guest_artifacts,
        work,
        machine=MachineSpec(1, 128, mem_file=work / "memory", mem_shared=True),
        drives=[Drive("vda", upper, read_only=False)],
    )
    await vm.start()
    try:
        await wait_for(lambda: "Linux version" in vm.serial_log.read_text(errors="replace"))
        _check_confined(
            vm,
            {
                str(guest_artifacts.kernel),
                str(base),
                *(str(work / f) for f in ("rootfs.qcow2", "memory", "serial.log", "qmp.sock")),
                str(work / "qemu.stderr"),
            },
        )
        # QEMU cannot open a host file outside its root, even one that is world-readable.
        node = {"driver": "raw", "node-name": "probe", "read-only": True}
        with pytest.raises(VMMError, match="No such file"):
            await vm._execute(
                "blockdev-add", {**node, "file": {"driver": "file", "filename": str(outside)}}
            )
        # A file that appears in its workdir later is there for it (how seals work).
        inside = work / "later.raw"
        inside.write_bytes(b"\0" * 65536)
        await vm._execute(
            "blockdev-add", {**node, "file": {"driver": "file", "filename": str(inside)}}
        )
        await vm._execute("blockdev-del", {"node-name": "probe"})
        # Seal: the new upper is the VM's, the sealed one no longer is.
        sealed = await vm.seal_disk("vda", work / "rootfs-1.qcow2")
        assert (work / "rootfs-1.qcow2").stat().st_uid == vm.uid
        assert sealed.stat().st_uid == 0 and sealed.stat().st_mode & 0o777 == 0o444
        # Saving the state inactivates the disks, which reopens the sealed upper by name:
        # read-only, as the VM may not write it any more (measured: O_RDWR without
        # auto-read-only, and the save failed).
        await vm.snapshot_create(tmp_path / "state")
        assert (tmp_path / "state").stat().st_size > 0
    finally:
        await vm.kill()


@pytest.mark.vm
async def test_snapshot_restore_pause_and_stream_when_confined(
    settings: Settings, guest_artifacts: Any, tmp_path: Path
) -> None:
    """Device state and RAM streams travel as descriptors (spawn=deny forbids `exec:`);
    a clone maps the snapshot's memory file read-only from a read-only bind."""
    shim = ensure_ram_shim(settings.cache)
    snap = tmp_path / "snap"
    snap.mkdir()
    src_dir = tmp_path / "src"
    src = make_vm(
        settings,
        guest_artifacts,
        src_dir,
        machine=MachineSpec(1, 128, mem_file=src_dir / "memory", mem_shared=True),
    )
    await src.start()
    try:
        await wait_for(lambda: "Linux version" in src.serial_log.read_text(errors="replace"))
        await src.snapshot_create(snap / "state")
    finally:
        await src.kill()
    os.rename(src_dir / "memory", snap / "memory")
    confine.disown(snap / "memory")
    clone_dir = tmp_path / "clone"
    clone = make_vm(
        settings,
        guest_artifacts,
        clone_dir,
        machine=MachineSpec(1, 128, mem_file=snap / "memory", mem_shared=False),
        incoming=True,
        ram_shim=shim,
    )
    await clone.start()
    try:
        await clone.snapshot_load(snap / "state")
        assert await clone.status() == VMStatus.RUNNING
        assert clone.pid is not None
        _check_confined(
            clone,
            {
                str(guest_artifacts.kernel),
                str(shim),
                str(snap / "memory"),
                *(str(clone_dir / f) for f in ("serial.log", "qmp.sock", "qemu.stderr")),
            },
        )
        # The snapshot's RAM file: mapped, but through a read-only descriptor.
        assert _ram_open_modes(clone.pid, snap / "memory") == {os.O_RDONLY}
        await clone.pause()
        assert await clone.status() == VMStatus.PAUSED
        await clone.resume()
        assert await clone.status() == VMStatus.RUNNING
        # A RAM stream of the clone loads into another confined VM.
        await clone.stream_save(clone_dir / "stream")
        assert (clone_dir / "stream").stat().st_size > MIB
    finally:
        await clone.kill()
    back_dir = tmp_path / "back"
    back = make_vm(
        settings,
        guest_artifacts,
        back_dir,
        machine=MachineSpec(1, 128, mem_file=back_dir / "memory", mem_shared=True),
        incoming=True,
    )
    await back.start()
    try:
        await back.stream_load(clone_dir / "stream")
        assert await back.status() == VMStatus.RUNNING
        assert _status(back.pid or 0)["Seccomp"] == "2"
    finally:
        await back.kill()


def _as_uid(
    uid: int, gid: int, *argv: str, enter: int | None = None
) -> subprocess.CompletedProcess[str]:
    """Run `argv` as `uid`/`gid` with no groups and no capabilities; with `enter`, inside that
    PID's mount namespace and root (where a confined QEMU's own file opens land)."""
    cmd = ["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups", "--inh-caps=-all"]
    if enter is not None:
        cmd = ["nsenter", f"--target={enter}", "--mount", "--root", "--wd=/", "--", *cmd]
    return subprocess.run([*cmd, *argv], capture_output=True, text=True, timeout=30, check=False)


@pytest.mark.vm
async def test_one_guest_cannot_reach_anothers_disk_or_memory(
    settings: Settings, guest_artifacts: Any, tmp_path: Path
) -> None:
    """Two confined VMs side by side: A's QEMU, whatever it is made to do, opens none of B's
    files — not by path from its root, not as its uid on the host, not through B's /proc."""
    base = tmp_path / "layers" / "base.qcow2"
    base.parent.mkdir()
    assert run("qemu-img", "create", "-q", "-f", "qcow2", base, "32M").returncode == 0
    vms: list[QemuVM] = []
    for name in ("a", "b"):
        work = tmp_path / name
        work.mkdir()
        create_upper_sync(base, work / "rootfs.qcow2")
        vms.append(
            make_vm(
                settings,
                guest_artifacts,
                work,
                name=f"vmtest-pair-{name}-{os.getpid()}",
                machine=MachineSpec(1, 128, mem_file=work / "memory", mem_shared=True),
                drives=[Drive("vda", work / "rootfs.qcow2", read_only=False)],
            )
        )
    a, b = vms
    try:
        for vm in vms:
            await vm.start()
        await wait_for(lambda: "Linux version" in b.serial_log.read_text(errors="replace"))
        assert a.uid != b.uid and a.gid != b.gid and a.pid and b.pid
        theirs = [b.workdir / "rootfs.qcow2", b.workdir / "memory"]
        for path in theirs:
            assert path.stat().st_uid == b.uid and path.stat().st_mode & 0o077 == 0
            # A's QEMU asked over QMP to open B's disk or RAM: not in its root.
            node = {"driver": "raw", "node-name": "probe", "read-only": True}
            with pytest.raises(VMMError, match="No such file"):
                await a._execute(
                    "blockdev-add", {**node, "file": {"driver": "file", "filename": str(path)}}
                )
            # A's uid, had it left its root: the files are B's alone.
            out = _as_uid(a.uid, a.gid, "head", "-c1", str(path))
            assert out.returncode != 0 and "Permission denied" in out.stderr, out
            # In A's mount namespace (what A's own opens see): not there at all.
            out = _as_uid(a.uid, a.gid, "head", "-c1", str(path), enter=a.pid)
            assert out.returncode != 0 and "No such file" in out.stderr, out
        # B's memory through /proc: another uid's process, and not dumpable by it.
        for proc_file in (f"/proc/{b.pid}/mem", f"/proc/{b.pid}/root/{b.workdir}/memory"):
            out = _as_uid(a.uid, a.gid, "head", "-c1", proc_file)
            assert out.returncode != 0, (proc_file, out)
        # No /proc in A's root to look for B through.
        assert not [f for f in _files_in_root(a.pid) if f.startswith("/proc/")]
    finally:
        for vm in vms:
            await vm.kill()
