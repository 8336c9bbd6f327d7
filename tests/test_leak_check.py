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
from agentenv.config import NetworkPlan
from agentenv.network import create_slot

def test_leaks_a_slot():
    asyncio.run(create_slot(NetworkPlan()))

def test_leaks_a_file(agentenv_home):
    (agentenv_home / "sandboxes").mkdir(exist_ok=True)
    (agentenv_home / "sandboxes" / "left-over").write_text("x")

def test_clean():
    pass
"""


def test_leak_check_catches_leaks(pytester: pytest.Pytester) -> None:
    pytester.makeconftest((Path(__file__).parent / "conftest.py").read_text())
    pytester.makepyfile(test_leaky=LEAKY)
    before = set(os.listdir("/run/netns")) if os.path.isdir("/run/netns") else set()
    try:
        result = pytester.runpytest_inprocess("-p", "no:cacheprovider")
        # Two tests fail their own check; the session check then fails the last teardown
        # too, because the leaked slot is still on the host.
        result.assert_outcomes(passed=3, errors=3)
        result.stdout.fnmatch_lines(["*left resources behind*network namespaces*"])
        result.stdout.fnmatch_lines(["*left resources behind*sandbox files*"])
        result.stdout.fnmatch_lines(["*session left resources behind*netns ae-s*"])
    finally:
        now = set(os.listdir("/run/netns")) if os.path.isdir("/run/netns") else set()
        leaked = [int(n[len(slot.NETNS_PREFIX) :]) for n in now - before if slot.made_here(n)]
        asyncio.run(cleanup_stale(NetworkPlan(), only=leaked))
