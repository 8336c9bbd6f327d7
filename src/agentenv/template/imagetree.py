"""The agentenv top layer of an image template: what a container image's tree needs to boot
as a sandbox, written into the mounted top filesystem (`configure_image_tree`).

An image is made for a container runtime, which supplies /etc/hosts, /etc/hostname and
/etc/resolv.conf at run time and needs no init. A sandbox boots the tree as a machine, with
our tools layer (init, envd and its own Python at ``/.agentenv``), so the tree gets:

* ``/.agentenv`` (where the tools layer stays after ``pivot_root``) and the mount points the
  guest init uses;
* ``/etc/hostname`` and ``/etc/hosts`` as `rootfs.configure_tree` writes them for ``base``, and
  no ``/etc/resolv.conf`` (the guest init writes one naming the slot's resolver when absent);
* a ``/bin/sh`` (and ``/bin/bash``, which the E2B SDK runs every command through) if the image
  has none: the tools layer's static busybox, so a busybox or distroless image still runs
  commands, whatever libc it has or lacks;
* the account E2B templates have: ``user`` with a home in ``/home/user``, no password, sudo
  without one where sudo exists (E2B's template build does the same with ``adduser``; we edit
  the files, since an image need not have ``adduser``); an existing ``user`` is kept;
* the image's WorkingDir, created if missing (Docker creates it at run time).

It also works out the default user for commands: the image's User (a name, or a uid looked up
in its /etc/passwd) if it sets one, else ``user`` as in E2B.

Paths are resolved inside the tree with chroot semantics: an absolute symlink (``/bin ->
/usr/bin``, ``/etc/resolv.conf -> /run/...``) restarts at the tree's root, ``..`` stops there,
and a file we write replaces a symlink at its path instead of writing through it.
"""

from __future__ import annotations

import os
import shutil
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path

from agentenv.oci.config import ImageConfig
from agentenv.template.errors import BuildError

DEFAULT_USER = "user"
FIRST_UID = 1000
HOME = "/home/user"
TOOLS = "/.agentenv"
BUSYBOX = f"{TOOLS}/bin/busybox"
# A script, not a symlink: busybox has no `bash` applet, but its `sh` runs `bash -l -c CMD`.
BASH_SHIM = (
    f"#!{BUSYBOX} sh\n# agentenv: the image has no bash; this is busybox sh.\n"
    f'exec {BUSYBOX} sh "$@"\n'
)
HOSTS = "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n"
MOUNT_POINTS = {TOOLS: 0o755, "/proc": 0o555, "/sys": 0o555, "/dev": 0o755, "/run": 0o755,
                "/tmp": 0o1777}  # fmt: skip
MAX_HOPS = 40


@dataclass
class TreeFacts:
    """What configuring found out, for the template record."""

    user: str  # default user for commands
    created_user: bool = False
    shell: str = "image"  # "image" or "busybox": where /bin/sh and /bin/bash come from
    notes: list[str] = field(default_factory=list)


class _Root:
    """Paths inside `root` with chroot semantics (see the module docstring)."""

    def __init__(self, root: Path) -> None:
        self.root = str(root)

    def host(self, parts: list[str]) -> str:
        return os.path.join(self.root, *parts) if parts else self.root

    def resolve(self, path: str, *, follow_last: bool) -> list[str]:
        pending = [p for p in path.split("/") if p not in ("", ".")]
        done: list[str] = []
        hops = 0
        while pending:
            comp = pending.pop(0)
            if comp == "..":
                if done:
                    done.pop()
                continue
            candidate = [*done, comp]
            if not pending and not follow_last:
                return candidate
            try:
                st = os.lstat(self.host(candidate))
            except FileNotFoundError:
                done = candidate
                continue
            if not stat.S_ISLNK(st.st_mode):
                done = candidate
                continue
            hops += 1
            if hops > MAX_HOPS:
                raise BuildError(f"image tree: too many symlinks resolving {path!r}")
            target = os.readlink(self.host(candidate))
            if target.startswith("/"):
                done = []
            pending = [p for p in target.split("/") if p not in ("", ".")] + pending
        return done

    def real(self, path: str) -> str:
        """Host path of `path` with every symlink followed (the last one too)."""
        return self.host(self.resolve(path, follow_last=True))

    def entry(self, path: str) -> str:
        """Host path of the entry `path` itself (its parents resolved, not the last part)."""
        return self.host(self.resolve(path, follow_last=False))

    def exists(self, path: str) -> bool:
        return os.path.exists(self.real(path))

    def read(self, path: str) -> str | None:
        try:
            with open(self.real(path), encoding="utf-8", errors="surrogateescape") as fh:
                return fh.read()
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            return None

    def makedirs(self, path: str, mode: int = 0o755) -> str:
        """Create `path` and its missing parents (root-owned, as Docker does)."""
        parts = self.resolve(path, follow_last=True)
        for i in range(1, len(parts) + 1):
            host = self.host(parts[:i])
            if os.path.lexists(host) and not os.path.isdir(host):
                raise BuildError(f"image tree: {'/'.join(parts[:i])!r} is not a directory")
            if not os.path.lexists(host):
                os.mkdir(host)
                os.chmod(host, mode if i == len(parts) else 0o755)
        return self.host(parts)

    def write(self, path: str, text: str, mode: int = 0o644) -> None:
        parent, _, _ = path.rpartition("/")
        self.makedirs(parent or "/")
        host = self.entry(path)
        if os.path.islink(host) or os.path.isfile(host):
            os.unlink(host)
        with open(host, "w", encoding="utf-8", errors="surrogateescape") as fh:
            fh.write(text)
        os.chmod(host, mode)

    def remove(self, path: str) -> None:
        host = self.entry(path)
        if os.path.islink(host) or os.path.isfile(host):
            os.unlink(host)

    def symlink(self, path: str, target: str) -> None:
        parent, _, _ = path.rpartition("/")
        self.makedirs(parent or "/")
        host = self.entry(path)
        if os.path.lexists(host):
            os.unlink(host)
        os.symlink(target, host)


def _table(text: str | None) -> list[list[str]]:
    if not text:
        return []
    return [line.split(":") for line in text.splitlines() if line.strip() and ":" in line]


def _render(rows: list[list[str]]) -> str:
    return "".join(":".join(r) + "\n" for r in rows)


def _free_id(taken: set[int]) -> int:
    n = FIRST_UID
    while n in taken:
        n += 1
    return n


def _ensure_shells(tree: _Root, facts: TreeFacts) -> None:
    if not tree.exists("/bin/sh"):
        tree.symlink("/bin/sh", BUSYBOX)
        facts.shell = "busybox"
    if not tree.exists("/bin/bash"):
        tree.write("/bin/bash", BASH_SHIM, 0o755)
        facts.shell = "busybox"


def _ensure_accounts(tree: _Root, facts: TreeFacts) -> None:
    passwd = _table(tree.read("/etc/passwd"))
    group = _table(tree.read("/etc/group"))
    if not any(r[0] == "root" for r in passwd):
        passwd.insert(0, ["root", "x", "0", "0", "root", "/root", "/bin/sh"])
        tree.makedirs("/root", 0o700)
    if not any(r[0] == "root" for r in group):
        group.insert(0, ["root", "x", "0", ""])
    user = next((r for r in passwd if r[0] == DEFAULT_USER), None)
    if user is None:
        facts.created_user = True
        uids = {int(r[2]) for r in passwd if len(r) > 2 and r[2].isdigit()}
        gids = {int(r[2]) for r in group if len(r) > 2 and r[2].isdigit()}
        existing = next((r for r in group if r[0] == DEFAULT_USER), None)
        if existing is not None and len(existing) > 2 and existing[2].isdigit():
            gid = int(existing[2])
        else:
            gid = _free_id(gids | uids)
            group.append([DEFAULT_USER, "x", str(gid), ""])
        uid = gid if gid not in uids else _free_id(uids | gids)
        passwd.append([DEFAULT_USER, "x", str(uid), str(gid), "", HOME, "/bin/bash"])
        shadow = tree.read("/etc/shadow")
        if shadow is not None:
            rows = _table(shadow)
            days = str(int(time.time() // 86400))
            rows.append([DEFAULT_USER, "", days, "0", "99999", "7", "", "", ""])
            tree.write("/etc/shadow", _render(rows), 0o640)
            _chgrp_shadow(tree, group)
        home = tree.makedirs(HOME, 0o750)
        skel = tree.real("/etc/skel")
        if os.path.isdir(skel):
            shutil.copytree(skel, home, symlinks=True, dirs_exist_ok=True)
        for dirpath, dirnames, filenames in os.walk(home):
            for n in [dirpath, *(os.path.join(dirpath, x) for x in dirnames + filenames)]:
                os.lchown(n, uid, gid)
    sudo = next((r for r in group if r[0] == "sudo"), None)
    if sudo is not None:
        while len(sudo) < 4:
            sudo.append("")
        members = [m for m in sudo[3].split(",") if m]
        if DEFAULT_USER not in members:
            sudo[3] = ",".join([*members, DEFAULT_USER])
    tree.write("/etc/passwd", _render(passwd))
    tree.write("/etc/group", _render(group))
    if tree.exists("/etc/sudoers"):
        tree.makedirs("/etc/sudoers.d", 0o755)
        tree.write(
            f"/etc/sudoers.d/{DEFAULT_USER}", f"{DEFAULT_USER} ALL=(ALL:ALL) NOPASSWD: ALL\n", 0o440
        )


def _chgrp_shadow(tree: _Root, group: list[list[str]]) -> None:
    # Debian's shadow is root:shadow 0640; keep that group if the image has it.
    row = next((r for r in group if r[0] == "shadow" and len(r) > 2 and r[2].isdigit()), None)
    if row is not None:
        os.chown(tree.real("/etc/shadow"), 0, int(row[2]))


def _default_user(tree: _Root, config: ImageConfig, facts: TreeFacts) -> str:
    spec = config.user.split(":", 1)[0]
    if not spec:
        return DEFAULT_USER
    passwd = _table(tree.read("/etc/passwd"))
    if spec.isdigit():
        row = next((r for r in passwd if len(r) > 2 and r[2] == spec), None)
    else:
        row = next((r for r in passwd if r[0] == spec), None)
    if row is None:
        facts.notes.append(
            f"the image's User {config.user!r} has no /etc/passwd entry; "
            f"commands run as {DEFAULT_USER!r}"
        )
        return DEFAULT_USER
    return row[0]


def configure_image_tree(root: Path, config: ImageConfig) -> TreeFacts:
    """Write the agentenv top layer into the mounted tree `root` (see the module docstring)."""
    tree = _Root(root)
    facts = TreeFacts(user=DEFAULT_USER)
    for path, mode in MOUNT_POINTS.items():
        if not os.path.lexists(tree.entry(path)):
            tree.makedirs(path, mode)
    tree.makedirs("/etc")
    tree.write("/etc/hostname", "sandbox\n")
    tree.write("/etc/hosts", HOSTS)
    tree.remove("/etc/resolv.conf")
    _ensure_shells(tree, facts)
    _ensure_accounts(tree, facts)
    if config.working_dir not in ("", "/") and not tree.exists(config.working_dir):
        tree.makedirs(config.working_dir)
    facts.user = _default_user(tree, config, facts)
    return facts
