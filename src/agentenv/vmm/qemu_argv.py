"""The QEMU command line of a guest (`QemuArgv.argv`: every QEMU command line is assembled
here), the devices it names and their version (`DEVICE_SET`), and what a confined launch
asks the launcher for: the jail's root, the files the VM's uid gets, the netns and cgroup.
Split from `qemu.py`: what QEMU is started as, apart from how the process is run."""

from __future__ import annotations

import contextlib
import json
from typing import Any

from agentenv.vmm import confine as vm_confine
from agentenv.vmm.base import MachineSpec
from agentenv.vmm.qemu_base import QemuBase
from agentenv.vmm.ramshim import preload_env
from agentenv.vmm.version import microvm_machine

# Bumped whenever the devices a guest gets change: device state saved with one set does not
# load into another. 2: free page reporting for every guest (clones through `ramshim`).
DEVICE_SET = "2"


# Every guest's balloon: free page reporting and deflate-on-oom. A guest whose RAM is a private
# mapping of a shared snapshot file discards through the preload library (`ramshim`), so its
# freed pages never reach that file. One device for every VM: snapshots load only into the
# device set that saved them.
BALLOON_DEVICE = "virtio-balloon-device,free-page-reporting=on,deflate-on-oom=on"


def private_ram(machine: MachineSpec) -> bool:
    """Guest RAM is a copy-on-write mapping of a memory file other guests map too."""
    return machine.mem_file is not None and not machine.mem_shared


class QemuArgv(QemuBase):
    """The command line and the confined launch of a `QemuVM`."""

    def argv(self) -> list[str]:
        m = self.machine
        machine_opts = microvm_machine(self.version)
        args = [self.qemu_binary]
        if m.mem_file is not None:
            machine_opts += ",memory-backend=mem"
            args += [
                "-object",
                f"memory-backend-file,id=mem,size={m.memory_mb}M,mem-path={m.mem_file},"
                f"share={'on' if m.mem_shared else 'off'}",
            ]
        args += ["-M", machine_opts, *self.accel.qemu_args]
        args += ["-smp", str(m.vcpus), "-m", f"{m.memory_mb}M"]
        args += ["-nodefaults", "-no-user-config", "-display", "none", "-no-reboot"]
        args += ["-serial", f"file:{self.serial_log}"]
        args += ["-qmp", f"unix:{self.qmp_socket},server=on,wait=off"]
        args += ["-kernel", str(self.boot.kernel)]
        if self.boot.initrd is not None:
            args += ["-initrd", str(self.boot.initrd)]
        words = self.boot.cmdline.split()
        words += [w for w in self.accel.cmdline if w not in words]
        cmdline = " ".join(words)
        if cmdline:
            args += ["-append", cmdline]
        for d in self.drives:
            node = {
                "driver": d.fmt,
                "node-name": f"{d.id}-0",
                "read-only": d.read_only,
                "file": {
                    "driver": "file",
                    "filename": str(d.path),
                    "read-only": d.read_only,
                    # Open for writing only while something writes: a sealed upper is
                    # reopened read-only (a confined QEMU may not write the sealed file,
                    # and QEMU 7.2 reopens it by name when a migration inactivates disks).
                    "auto-read-only": not d.read_only,
                },
            }
            args += ["-blockdev", json.dumps(node, separators=(",", ":"))]
            args += ["-device", f"virtio-blk-device,drive={d.id}-0,id={d.id}"]
        if self.net is not None:
            args += [
                "-netdev",
                f"tap,id=n0,ifname={self.net.tap},script=no,downscript=no",
                "-device",
                f"virtio-net-device,netdev=n0,mac={self.net.mac}",
            ]
        if m.balloon:
            args += ["-device", BALLOON_DEVICE]
        if self.incoming:
            args += ["-S", "-incoming", "defer"]
        if self.confine:
            args += ["-sandbox", vm_confine.SANDBOX]
        return args

    def _jail(self) -> vm_confine.Jail:
        """The root this VM's QEMU gets: everything it opens, nothing else (reads disk
        headers: not on the event loop)."""
        jail = vm_confine.Jail(
            self.uid,
            self.gid,
            rw_dirs=[self.launch_workdir],
            programs=(self.qemu_binary, *vm_confine.QEMU_HELPERS),
        )
        if not self.qmp_socket.is_relative_to(self.launch_workdir):
            jail.rw_dirs.append(self.qmp_socket.parent)
        jail.add_ro(self.boot.kernel)
        if self.boot.initrd is not None:
            jail.add_ro(self.boot.initrd)
        for d in self.drives:
            if d.read_only:
                jail.add_ro(d.path)
            else:
                jail.add_rw(d.path)
            for backing in vm_confine.backing_chain(d.path):
                jail.add_ro(backing)
        m = self.machine
        if m.mem_file is not None:
            if m.mem_shared:
                jail.add_rw(m.mem_file)
            else:
                jail.add_ro(m.mem_file)
        if private_ram(m) and self.ram_shim is not None:
            jail.add_ro(self.ram_shim)
        if self.net is not None:
            jail.devices.append("/dev/net/tun")
            if self.net.detached:
                jail.make_tap = self.net.tap
        if "kvm" in self.accel.qemu_args:
            jail.devices.append("/dev/kvm")
        return jail

    def _prepare_files(self) -> None:
        """Give the VM's uid what it writes; the workdir stays the server's (sticky, the
        VM's group), so QEMU can add files to it but not touch the server's."""
        vm_confine.prepare_host()
        vm_confine.own_dir(self.workdir, self.gid)
        if not self.qmp_socket.is_relative_to(self.workdir):
            vm_confine.own_dir(self.qmp_socket.parent, self.gid)
        mine = [d.path for d in self.drives if not d.read_only]
        m = self.machine
        if m.mem_file is not None and m.mem_shared:
            if not m.mem_file.is_relative_to(self.workdir) and not m.mem_file.exists():
                # Bound into the root by name, so it must exist before QEMU does.
                m.mem_file.touch(0o600)
            mine.append(m.mem_file)
        mine.append(self.serial_log)
        for path in mine:
            if path.exists():
                vm_confine.give(path, self.uid, self.gid)
        # What it only reads but another VM's uid owns (a converter reads the paused
        # sandbox's upper): the server's from now on, readable by any VM that gets it bound.
        for d in self.drives:
            for path in [*([d.path] if d.read_only else []), *vm_confine.backing_chain(d.path)]:
                with contextlib.suppress(FileNotFoundError):
                    if path.stat().st_uid != 0:
                        vm_confine.disown(path)

    def _launch_plan(self, jail: vm_confine.Jail | None = None) -> dict[str, Any]:
        """What the launcher (`vmm.launcher`) does to start this VM's QEMU: join the cgroup
        (so QEMU never runs outside it), enter the slot's network namespace (or a new one:
        the device state of virtio-net needs a tap backend, and a namespace of its own gives
        a detached VM one that disappears with the process), build the jail and exec; under
        TCG with transparent huge pages off for QEMU."""
        env: dict[str, str] = {}
        if private_ram(self.machine):
            assert self.ram_shim is not None and self.machine.mem_file is not None
            env = preload_env(self.ram_shim, self.machine.mem_file)
        detached = self.net is not None and self.net.detached
        return {
            "argv": self.argv(),
            "env": env,
            "cgroup_procs": []
            if self.cgroup is None
            else [str(f) for f in self.cgroup.procs_files],
            "netns": None if detached or self.netns is None else f"/run/netns/{self.netns}",
            "new_net": detached,
            "pid_ns": jail is not None and vm_confine.pid_namespaces(),
            # No transparent huge pages under TCG (docs/vmm.md, host cost per clone); a KVM
            # guest's RAM keeps them.
            "no_thp": self.accel.name == "tcg",
            "jail": None if jail is None else jail.plan(),
        }
