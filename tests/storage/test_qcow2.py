"""In-process qcow2 headers against qemu-img: what we write it accepts, what it writes we read."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from agentenv.storage import images, qcow2

MIB = 1024 * 1024


def qemu_img(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["qemu-img", *args], capture_output=True, text=True, check=False)


def img_info(path: Path) -> dict[str, object]:
    out = qemu_img("info", "-U", "--output=json", str(path))
    assert out.returncode == 0, out.stderr
    data: dict[str, object] = json.loads(out.stdout)
    return data


def make_base(path: Path, size: str, compat: str = "1.1") -> Path:
    out = qemu_img("create", "-q", "-f", "qcow2", "-o", f"compat={compat}", str(path), size)
    assert out.returncode == 0, out.stderr
    return path


@pytest.mark.parametrize("size", [64 * MIB, 3 * 1024 * MIB + 512, 5 * 1024 * 1024 * MIB])
def test_overlay_passes_qemu_img_check_and_info(tmp_path: Path, size: int) -> None:
    # 5 TiB needs an L1 table of more than one cluster; 3 GiB + 512 is not cluster-aligned.
    base = make_base(tmp_path / "base.qcow2", "64M")
    upper = tmp_path / "upper.qcow2"
    qcow2.write_overlay(upper, size, str(base), "qcow2")
    check = qemu_img("check", "--output=json", str(upper))
    assert check.returncode == 0, check.stdout + check.stderr
    report = json.loads(check.stdout)
    assert report.get("leaks", 0) == 0 and report.get("corruptions", 0) == 0
    data = img_info(upper)
    assert data["format"] == "qcow2" and data["virtual-size"] == size
    assert data["backing-filename"] == str(base) and data["backing-filename-format"] == "qcow2"
    assert (data["format-specific"] or {})["data"]["compat"] == "1.1"  # type: ignore[index]
    # Sparse: only the metadata clusters hold data on disk.
    assert upper.stat().st_blocks * 512 <= 4 * qcow2.CLUSTER_SIZE + upper.stat().st_size // 64


@pytest.mark.parametrize("compat", ["0.10", "1.1"])
def test_header_read_matches_qemu_img(tmp_path: Path, compat: str) -> None:
    base = make_base(tmp_path / "base.qcow2", "96M")
    child = tmp_path / "child.qcow2"
    out = qemu_img(
        "create", "-q", "-f", "qcow2", "-o", f"compat={compat}", "-F", "qcow2",
        "-b", "base.qcow2", str(child), "128M",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    got = images.info(child)
    assert (got.format, got.virtual_size, got.backing_file) == ("qcow2", 128 * MIB, base)
    header = qcow2.read_header(child)
    assert header.backing_file == "base.qcow2" and header.backing_format == "qcow2"
    assert images.info(base).backing_file is None


def test_write_refuses_existing_and_bad_input(tmp_path: Path) -> None:
    dest = tmp_path / "upper.qcow2"
    dest.write_bytes(b"keep")
    with pytest.raises(FileExistsError):
        qcow2.write_overlay(dest, MIB, "/base", "qcow2")
    assert dest.read_bytes() == b"keep"
    with pytest.raises(qcow2.Qcow2Error):
        qcow2.overlay_bytes(0, "/base", "qcow2")
    with pytest.raises(qcow2.Qcow2Error):
        qcow2.overlay_bytes(MIB, "/" + "x" * 2000, "qcow2")
    with pytest.raises(qcow2.Qcow2Error):
        qcow2.read_header(dest)
    dest.write_bytes(b"\0" * 4096)
    assert not qcow2.is_qcow2(dest)
