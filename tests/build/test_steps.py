"""The COPY script's placement rules, run with the host's sh on a scratch tree (no VM)."""

from __future__ import annotations

import io
import os
import subprocess
import tarfile
from pathlib import Path

from agentenv.build.steps import copy_script, workdir_script


def make_tar(path: Path, files: dict[str, str]) -> None:
    with tarfile.open(path, "w:gz") as tar:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def run(tmp: Path, src: str, dest: str, files: dict[str, str], mode: str = "") -> None:
    staging = tmp / "ctx.tar"
    make_tar(staging, files)
    script = copy_script(
        src, str(tmp / dest) + ("/" if dest.endswith("/") else ""), "", mode, str(staging)
    )
    subprocess.run(["sh", "-c", script], check=True, capture_output=True, timeout=30)
    assert not staging.exists()


def test_directory_contents_go_into_dest(tmp_path: Path) -> None:
    run(tmp_path, "src/", "app", {"src/a.py": "A", "src/sub/b.py": "B"})
    assert (tmp_path / "app/a.py").read_text() == "A"
    assert (tmp_path / "app/sub/b.py").read_text() == "B"


def test_file_into_dir_or_as_name(tmp_path: Path) -> None:
    run(tmp_path, "x.txt", "d/", {"x.txt": "X"})
    assert (tmp_path / "d/x.txt").read_text() == "X"
    run(tmp_path, "x.txt", "y.conf", {"x.txt": "Y"}, mode="0600")
    assert (tmp_path / "y.conf").read_text() == "Y"
    assert (tmp_path / "y.conf").stat().st_mode & 0o777 == 0o600


def test_glob_copies_each_match(tmp_path: Path) -> None:
    run(tmp_path, "*.txt", "many", {"a.txt": "1", "b.txt": "2"})
    assert sorted(p.name for p in (tmp_path / "many").iterdir()) == ["a.txt", "b.txt"]


def test_workdir_is_made_for_the_current_user(tmp_path: Path) -> None:
    target = tmp_path / "a b" / "app"
    subprocess.run(["sh", "-c", workdir_script(str(target), "nobody")], check=True)
    assert target.is_dir()
    assert target.stat().st_uid == 65534
    # An existing directory keeps its owner.
    os.chown(target, 0, 0)
    subprocess.run(["sh", "-c", workdir_script(str(target), "nobody:nogroup")], check=True)
    assert target.stat().st_uid == 0
