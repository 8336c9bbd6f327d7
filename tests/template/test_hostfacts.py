"""Host facts (apt-cache, dpkg-query, `--version` answers) are reused while what they read is
unchanged, and asked again once it changes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from agentenv.template import hostfacts
from agentenv.template.debian import installed_versions


@pytest.fixture(autouse=True)
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("AGENTENV_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_an_answer_is_reused_until_what_it_read_changes(tmp_path: Path, cache: Path) -> None:
    source = tmp_path / "status"
    source.write_text("one")
    calls: list[str] = []

    def ask() -> str:
        calls.append(source.read_text())
        return f"answer from {source.read_text()}"

    assert hostfacts.remembered(["q", "x"], [source], ask) == "answer from one"
    assert hostfacts.remembered(["q", "x"], [source], ask) == "answer from one"
    assert calls == ["one"]
    # Another query is its own entry.
    assert hostfacts.remembered(["q", "y"], [source], ask) == "answer from one"
    assert len(calls) == 2
    source.write_text("two!")  # new size and mtime: asked again
    assert hostfacts.remembered(["q", "x"], [source], ask) == "answer from two!"
    source.unlink()  # gone is a state too
    assert hostfacts.remembered(["q", "x"], [source], lambda: "none") == "none"
    assert (cache / hostfacts.FACTS_FILE).is_file()


def test_a_damaged_facts_file_is_asked_again_and_rewritten(tmp_path: Path, cache: Path) -> None:
    cache.mkdir(parents=True)
    (cache / hostfacts.FACTS_FILE).write_text("{not json")
    assert hostfacts.remembered(["q"], [tmp_path], lambda: "fresh") == "fresh"
    assert hostfacts.remembered(["q"], [tmp_path], lambda: "stale") == "fresh"
    assert not [p for p in cache.iterdir() if p.name.startswith(".host-facts-")]


def test_an_unwritable_cache_still_answers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("AGENTENV_CACHE", str(blocker / "cache"))  # under a file: mkdir fails
    assert hostfacts.remembered(["q"], [tmp_path], lambda: "answer") == "answer"


def test_dpkg_and_tool_answers_match_a_fresh_query() -> None:
    # The installed version of Python's own package, from dpkg and then from the facts file.
    first = installed_versions(["python3.11-minimal", "no-such-package-xyz"])
    again = installed_versions(["python3.11-minimal", "no-such-package-xyz"])
    assert first == again and first["no-such-package-xyz"] is None
    version = hostfacts.tool_version("python3")
    assert version is not None and version.startswith("Python 3")
    assert hostfacts.tool_version("no-such-tool-xyz") is None
    assert os.environ["AGENTENV_CACHE"].endswith("cache")
