"""The leak check itself must fail a test that leaves a slot or a sandbox file behind."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from agentenv.config import NetworkPlan
from agentenv.network import cleanup_stale, slot

pytest_plugins = ["pytester"]

LEAKY = """
import asyncio
import pytest
from agentenv.config import NetworkPlan
from agentenv.network import create_slot

@pytest.mark.host
def test_leaks_a_slot():
    asyncio.run(create_slot(NetworkPlan()))

def test_leaks_a_file(agentenv_home):
    (agentenv_home / "sandboxes").mkdir(exist_ok=True)
    (agentenv_home / "sandboxes" / "left-over").write_text("x")

def test_clean():
    pass

def test_leaks_unmarked():
    # Not marked: no per-test check; the run-end check still finds it.
    asyncio.run(create_slot(NetworkPlan()))
"""


def test_leak_check_catches_leaks(pytester: pytest.Pytester) -> None:
    pytester.makeconftest((Path(__file__).parent / "conftest.py").read_text())
    pytester.makepyfile(test_leaky=LEAKY)
    try:
        result = pytester.runpytest_inprocess("-p", "no:cacheprovider")
        # Two tests fail their own check (the unmarked leaker has none); the run-end check
        # then fails the run, because the leaked slots are still on the host.
        result.assert_outcomes(passed=4, errors=2)
        assert result.ret == pytest.ExitCode.TESTS_FAILED
        result.stdout.fnmatch_lines(["*left resources behind*network namespaces*"])
        result.stdout.fnmatch_lines(["*left resources behind*sandbox files*"])
        result.stdout.fnmatch_lines(["*session left resources behind*netns ae-s*"])
    finally:
        now = set(os.listdir("/run/netns")) if os.path.isdir("/run/netns") else set()
        leaked = [int(n[len(slot.NETNS_PREFIX) :]) for n in now if slot.made_here(n)]
        asyncio.run(cleanup_stale(NetworkPlan(), only=leaked))
