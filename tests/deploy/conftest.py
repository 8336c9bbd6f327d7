"""tests/deploy reads files only. The suite's leak checks (tests/conftest.py) look at host-wide
state (the nft table, QEMU processes, sandbox cgroups) that another session's VM tests change
at any moment; nothing here makes host state, so here they are off."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True)
def leak_check() -> Iterator[None]:
    yield


@pytest.fixture(scope="session", autouse=True)
def no_leaks_at_session_end() -> Iterator[None]:
    yield
