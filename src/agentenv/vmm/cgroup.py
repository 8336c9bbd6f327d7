"""Per-sandbox cgroups with memory, cpu and pids limits, on cgroup v1 or v2.

Hosts differ: this one mounts v1 controllers under /sys/fs/cgroup/<controller> next to an
empty v2 hierarchy; a modern host has one v2 tree. The limits are the same either way.
"""

from __future__ import annotations

import contextlib
import errno
import os
import time
from dataclasses import dataclass
from pathlib import Path

from agentenv.vmm.errors import VMMError

CGROUP_ROOT = Path("/sys/fs/cgroup")
PARENT = "agentenv"
CONTROLLERS = ("memory", "cpu", "pids")
CPU_PERIOD_US = 100_000
# Cgroup names this process has created (never pruned), to tell them from other servers'.
created_here: set[str] = set()


@dataclass(frozen=True)
class Limits:
    memory_bytes: int
    cpus: float
    pids: int


def is_v2(root: Path = CGROUP_ROOT) -> bool:
    return (root / "cgroup.controllers").is_file()


def parent_dirs(root: Path = CGROUP_ROOT) -> list[Path]:
    """Where sandbox cgroups live on this host (one per v1 controller, or one on v2)."""
    if is_v2(root):
        return [root / PARENT]
    return [root / c / PARENT for c in CONTROLLERS if (root / c / "cgroup.procs").is_file()]


def _write(path: Path, value: str) -> None:
    try:
        path.write_text(value)
    except OSError as exc:
        raise VMMError(f"cannot write {value!r} to {path}: {exc.strerror}") from exc


def _enable_v2_controllers(root: Path) -> None:
    wanted = " ".join(f"+{c}" for c in CONTROLLERS)
    for d in (root, root / PARENT):
        ctl = d / "cgroup.subtree_control"
        if not all(c in ctl.read_text().split() for c in CONTROLLERS):
            _write(ctl, wanted)


class Cgroup:
    """One sandbox's cgroup; `dirs` has one directory per hierarchy it spans."""

    def __init__(self, name: str, root: Path = CGROUP_ROOT) -> None:
        if not name or "/" in name or name.startswith("."):
            raise VMMError(f"bad cgroup name {name!r}")
        self.name = name
        self.root = root
        self.dirs = [p / name for p in parent_dirs(root)]
        if not self.dirs:
            raise VMMError("no usable cgroup hierarchy (mount cgroup v2 or v1 memory/cpu/pids)")

    def rename(self, new_name: str) -> None:
        """Give the cgroup (with the processes in it) a new name in the same parent: cgroup
        directories may be renamed within their parent, and membership follows."""
        renamed = Cgroup(new_name, self.root)
        created_here.add(new_name)
        for old, new in zip(self.dirs, renamed.dirs, strict=True):
            if old.exists():
                os.rename(old, new)
        self.name, self.dirs = renamed.name, renamed.dirs

    def create(self, limits: Limits) -> None:
        """Make the cgroup and set its limits; removes what it made if a limit fails."""
        if is_v2(self.root):
            (self.root / PARENT).mkdir(exist_ok=True)
            _enable_v2_controllers(self.root)
        try:
            created_here.add(self.name)
            for d in self.dirs:
                d.parent.mkdir(exist_ok=True)
                d.mkdir()
            self._set(limits)
        except BaseException:
            self.remove()
            raise

    def _set(self, limits: Limits) -> None:
        quota = max(1000, int(limits.cpus * CPU_PERIOD_US))
        for d in self.dirs:
            if is_v2(self.root):
                _write(d / "memory.max", str(limits.memory_bytes))
                _write(d / "cpu.max", f"{quota} {CPU_PERIOD_US}")
                _write(d / "pids.max", str(limits.pids))
                continue
            controller = d.parent.parent.name
            if controller == "memory":
                _write(d / "memory.limit_in_bytes", str(limits.memory_bytes))
            elif controller == "cpu":
                _write(d / "cpu.cfs_period_us", str(CPU_PERIOD_US))
                _write(d / "cpu.cfs_quota_us", str(quota))
            elif controller == "pids":
                _write(d / "pids.max", str(limits.pids))

    @property
    def procs_files(self) -> list[Path]:
        return [d / "cgroup.procs" for d in self.dirs]

    def pids(self) -> set[int]:
        out: set[int] = set()
        for f in self.procs_files:
            with contextlib.suppress(FileNotFoundError):
                out.update(int(x) for x in f.read_text().split())
        return out

    def remove(self) -> None:
        """Remove the directories; the kernel refuses while a task is still inside, so wait a
        moment for an exiting process to leave."""
        for d in self.dirs:
            for _ in range(100):
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError as exc:
                    if exc.errno != errno.EBUSY:
                        raise VMMError(f"cannot remove cgroup {d}: {exc.strerror}") from exc
                    time.sleep(0.01)
            else:
                raise VMMError(f"cgroup {d} still has tasks: {sorted(self.pids())}")


def stale(root: Path = CGROUP_ROOT) -> list[Path]:
    out: list[Path] = []
    for p in parent_dirs(root):
        if p.is_dir():
            out.extend(sorted(x for x in p.iterdir() if x.is_dir()))
    return out
