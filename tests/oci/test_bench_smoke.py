"""bench/templates.py part (a) at a tiny scale, so the benchmark does not rot: an image made
from two small host directories, pushed to a loopback registry, pulled into block layers and,
as the baseline, copied by skopeo and untarred. Numbers are printed, not asserted."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import templates as bench


def test_pull_bench_quick(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    if shutil.which("skopeo") is None:
        pytest.fail("skopeo is needed (the bench's baseline): scripts/test installs it")
    res = bench.bench_pull(tmp_path, bench.QUICK_LAYERS, runs=1)
    out = capsys.readouterr().out
    assert "ratio agentenv/baseline" in out, out
    assert res["content_mb"] > 1 and res["compressed_mb"] > 0
    assert res["ours_convert_s"] > 0 and res["base_untar_s"] > 0
    assert not list(tmp_path.glob("ours*")) and not list(tmp_path.glob("base*"))
    print(out)
