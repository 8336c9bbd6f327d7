"""The agentenv top layer of image templates, written into plain directories (no mounts)."""

from __future__ import annotations

import os
from pathlib import Path

from agentenv.oci.config import ImageConfig
from agentenv.oci.manifest import LINUX_AMD64
from agentenv.template.imagetree import BASH_SHIM, BUSYBOX, configure_image_tree


def cfg(**kw: object) -> ImageConfig:
    return ImageConfig(platform=LINUX_AMD64, **kw)  # type: ignore[arg-type]


def lines(path: Path) -> list[list[str]]:
    return [line.split(":") for line in path.read_text().splitlines()]


def test_scratch_image_gets_shell_accounts_and_machine_files(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    facts = configure_image_tree(root, cfg(working_dir="/srv/app"))
    assert facts.user == "user" and facts.created_user and facts.shell == "busybox"
    assert os.readlink(root / "bin/sh") == BUSYBOX
    assert (root / "bin/bash").read_text() == BASH_SHIM
    assert os.stat(root / "bin/bash").st_mode & 0o111
    passwd = lines(root / "etc/passwd")
    assert passwd[0][:4] == ["root", "x", "0", "0"]
    assert ["user", "x", "1000", "1000", "", "/home/user", "/bin/bash"] in passwd
    assert ["user", "x", "1000", ""] in lines(root / "etc/group")
    home = os.stat(root / "home/user")
    assert (home.st_uid, home.st_gid) == (1000, 1000)
    assert (root / "etc/hostname").read_text() == "sandbox\n"
    assert "localhost" in (root / "etc/hosts").read_text()
    assert not (root / "etc/resolv.conf").exists()
    assert (root / ".agentenv").is_dir() and (root / "srv/app").is_dir()
    assert os.stat(root / "tmp").st_mode & 0o7777 == 0o1777
    # No sudo in the image: no sudoers file appears.
    assert not (root / "etc/sudoers.d").exists()


def test_debian_like_tree_symlinks_taken_uid_sudo_shadow(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "usr/bin").mkdir(parents=True)
    (root / "etc/skel").mkdir(parents=True)
    (root / "run").mkdir()
    os.symlink("usr/bin", root / "bin")  # merged /usr
    (root / "usr/bin/bash").write_text("#!real bash\n")
    (root / "usr/bin/dash").write_text("#!dash\n")
    os.symlink("dash", root / "usr/bin/sh")
    (root / "etc/skel/.bashrc").write_text("# skel\n")
    (root / "etc/passwd").write_text(
        "root:x:0:0:root:/root:/bin/bash\nnode:x:1000:1000::/home/node:/bin/bash\n"
    )
    (root / "etc/group").write_text("root:x:0:\nshadow:x:42:\nsudo:x:27:node\nnode:x:1000:\n")
    (root / "etc/shadow").write_text("root:*:19000:0:99999:7:::\n")
    (root / "etc/sudoers").write_text("@includedir /etc/sudoers.d\n")
    os.symlink("/run/systemd/resolve/stub-resolv.conf", root / "etc/resolv.conf")
    facts = configure_image_tree(root, cfg(user="1000:1000"))
    # The image's own shells stay.
    assert facts.shell == "image"
    assert (root / "usr/bin/bash").read_text() == "#!real bash\n"
    assert os.readlink(root / "usr/bin/sh") == "dash"
    assert os.path.islink(root / "bin")
    # uid/gid 1000 are node's: user gets the next free ones, sudo, shadow and sudoers.
    assert ["user", "x", "1001", "1001", "", "/home/user", "/bin/bash"] in lines(
        root / "etc/passwd"
    )
    assert ["sudo", "x", "27", "node,user"] in lines(root / "etc/group")
    assert any(r[0] == "user" and r[1] == "" for r in lines(root / "etc/shadow"))
    assert os.stat(root / "etc/shadow").st_gid == 42
    assert (root / "etc/sudoers.d/user").read_text() == "user ALL=(ALL:ALL) NOPASSWD: ALL\n"
    assert oct(os.stat(root / "etc/sudoers.d/user").st_mode & 0o777) == "0o440"
    assert (root / "home/user/.bashrc").read_text() == "# skel\n"
    assert os.stat(root / "home/user/.bashrc").st_uid == 1001
    # The resolver symlink is gone (not followed: /run had no such file to remove).
    assert not os.path.lexists(root / "etc/resolv.conf")
    # The image's User 1000 is node.
    assert facts.user == "node"


def test_existing_user_is_kept_and_unknown_image_user_falls_back(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "etc").mkdir(parents=True)
    (root / "bin").mkdir()
    (root / "bin/sh").write_text("sh")
    (root / "bin/bash").write_text("bash")
    passwd = "root:x:0:0:root:/root:/bin/sh\nuser:x:1000:1000::/home/user:/bin/bash\n"
    (root / "etc/passwd").write_text(passwd)
    (root / "etc/group").write_text("root:x:0:\nuser:x:1000:\n")
    facts = configure_image_tree(root, cfg(user="nobody-here"))
    assert not facts.created_user and facts.user == "user"
    assert "nobody-here" in facts.notes[0]
    assert (root / "etc/passwd").read_text() == passwd
    assert not (root / "home/user").exists()  # kept as the image had it


def test_writes_stay_inside_the_tree(tmp_path: Path) -> None:
    """An absolute symlink in the image resolves inside the tree, never on the host."""
    root = tmp_path / "root"
    outside = tmp_path / "outside"
    outside.mkdir()
    root.mkdir()
    os.symlink(str(outside), root / "etc")  # /etc -> <host path>: inside the tree that is
    configure_image_tree(root, cfg())
    assert list(outside.iterdir()) == []
    inside = root / str(outside).lstrip("/")
    assert (inside / "passwd").is_file() and (inside / "hostname").is_file()
