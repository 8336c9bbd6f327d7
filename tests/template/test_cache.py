"""The artifact cache: keyed by inputs, published atomically, never trusting half builds."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from agentenv.template.cache import BUILD_FILE, INPUTS_FILE, ArtifactCache, digest_files


def _writer(calls: list[str], text: str = "payload"):
    def build(out: Path) -> None:
        calls.append(out.name)
        (out / "artifact").write_text(text)

    return build


def test_same_inputs_hit_the_cache(tmp_path: Path) -> None:
    cache = ArtifactCache(tmp_path)
    calls: list[str] = []
    first, built = cache.ensure("thing", {"a": "1"}, _writer(calls))
    again, built_again = cache.ensure("thing", {"a": "1"}, _writer(calls))
    assert (built, built_again) == (True, False)
    assert first == again
    assert len(calls) == 1
    assert (first / "artifact").read_text() == "payload"
    assert '"a": "1"' in (first / INPUTS_FILE).read_text()


def test_changed_input_rebuilds(tmp_path: Path) -> None:
    cache = ArtifactCache(tmp_path)
    calls: list[str] = []
    one, _ = cache.ensure("thing", {"a": "1"}, _writer(calls))
    two, built = cache.ensure("thing", {"a": "2"}, _writer(calls))
    assert built and one != two
    assert len(calls) == 2
    assert cache.lookup("thing", {"a": "1"}) == one
    assert cache.lookup("thing", {"a": "3"}) is None


def test_failed_build_publishes_nothing_and_is_retried(tmp_path: Path) -> None:
    cache = ArtifactCache(tmp_path)

    def broken(out: Path) -> None:
        (out / "half").write_text("partial")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        cache.ensure("thing", {"a": "1"}, broken)
    assert cache.lookup("thing", {"a": "1"}) is None
    assert not list(tmp_path.glob(".tmp-*"))
    calls: list[str] = []
    path, built = cache.ensure("thing", {"a": "1"}, _writer(calls))
    assert built and (path / "artifact").exists() and not (path / "half").exists()


def test_killed_build_is_not_taken_as_done(tmp_path: Path) -> None:
    """A build process killed mid-way leaves a temp dir that the next build discards."""
    script = textwrap.dedent(
        f"""
        import time
        from pathlib import Path
        from agentenv.template.cache import ArtifactCache

        def build(out):
            (out / "half").write_text("partial")
            print("building", flush=True)
            time.sleep(60)

        ArtifactCache(Path({str(tmp_path)!r})).ensure("thing", {{"a": "1"}}, build)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "building"
        assert list(tmp_path.glob(".tmp-*"))
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    cache = ArtifactCache(tmp_path)
    assert cache.lookup("thing", {"a": "1"}) is None
    calls: list[str] = []
    t0 = time.monotonic()
    path, built = cache.ensure("thing", {"a": "1"}, _writer(calls))
    assert built and time.monotonic() - t0 < 5  # the dead builder's lock is gone with it
    assert sorted(p.name for p in path.iterdir()) == ["artifact", BUILD_FILE, INPUTS_FILE]
    assert not list(tmp_path.glob(".tmp-*"))


def test_digest_files_follows_content(tmp_path: Path) -> None:
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "x.py").write_text("a = 1\n")
    before = digest_files(tmp_path / "d")
    (tmp_path / "d" / "__pycache__").mkdir()
    (tmp_path / "d" / "__pycache__" / "x.pyc").write_bytes(b"junk")
    assert digest_files(tmp_path / "d") == before
    (tmp_path / "d" / "x.py").write_text("a = 2\n")
    assert digest_files(tmp_path / "d") != before


def test_build_time_is_recorded(tmp_path: Path) -> None:
    cache = ArtifactCache(tmp_path)
    path, _ = cache.ensure("thing", {"a": "1"}, _writer([]))
    info = ArtifactCache.build_info(path)
    assert info["build_seconds"] >= 0 and info["built_at"] > 0


def test_prune_keeps_current_and_recent_artifacts(tmp_path: Path) -> None:
    cache = ArtifactCache(tmp_path)
    old, _ = cache.ensure("thing", {"a": "1"}, _writer([]))
    current, _ = cache.ensure("thing", {"a": "2"}, _writer([]))
    fresh, _ = cache.ensure("thing", {"a": "3"}, _writer([]))
    past = time.time() - 7200
    for p in (old, current):
        os.utime(p / INPUTS_FILE, (past, past))
    assert cache.prune({current}) == [old]
    assert not old.exists() and current.is_dir() and fresh.is_dir()
