"""agentenv.files: the on-disk names old homes hold (crash recovery reads them), and no other
module joining a sandbox's or the snapshot repository's paths itself."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from agentenv.config import Settings
from agentenv.files import SandboxFiles, home_snapshots_dir, sandbox_files, snapshots_dir

SRC = Path(__file__).resolve().parents[1] / "src" / "agentenv"
# A join of a sandbox workdir or the snapshots dir written outside files.py. The smoke boot's
# scratch dir (template/smoke.py) is no sandbox: its `Path(scratch) / "serial.log"` is allowed, and
# the remote snapshot cache's `state_dir / "snapshots"` is its own dir, not the repository.
JOIN = re.compile(
    r'sandboxes_dir /|(?<!state_dir) / "snapshots"|"paused\.json"|"rootfs\.qcow2"|"sandbox\.json"'
    r'|workdir / "serial\.log"|f"rootfs-\{'
)


def test_paths_are_the_ones_old_homes_hold(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AGENTENV_HOME", str(tmp_path))
    settings = Settings.from_env()
    files = sandbox_files(settings, "sbx1")
    assert files == SandboxFiles(settings.sandboxes_dir / "sbx1")
    assert files.id == "sbx1"
    names = [files.meta, files.upper, files.memory, files.serial_log, files.paused]
    assert [p.name for p in names] == [
        "sandbox.json",
        "rootfs.qcow2",
        "memory",
        "serial.log",
        "paused.json",
    ]
    assert all(p.parent == settings.sandboxes_dir / "sbx1" for p in names)
    assert files.file("state") == files.workdir / "state"
    files.workdir.mkdir(parents=True)
    assert files.next_upper().name == "rootfs-1.qcow2"
    files.next_upper().touch()
    assert files.next_upper().name == "rootfs-2.qcow2"
    assert snapshots_dir(settings) == tmp_path / "snapshots" == home_snapshots_dir(tmp_path)


def test_nothing_else_joins_sandbox_paths() -> None:
    offenders = [
        f"{path.relative_to(SRC)}:{n}: {line.strip()}"
        for path in sorted(SRC.rglob("*.py"))
        if path.name != "files.py" and "/gen/" not in str(path)
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if JOIN.search(line)
    ]
    assert offenders == []
