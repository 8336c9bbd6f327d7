"""Host package checks against the real dpkg database."""

from __future__ import annotations

import time

from agentenv import hostdeps
from agentenv.template.debian import installed_version


def test_missing_packages_are_found_by_dpkg() -> None:
    missing = hostdeps.missing_packages(["busybox-static", "agentenv-no-such-package"])
    assert missing == ["agentenv-no-such-package"]
    assert installed_version("busybox-static")


def test_second_run_installs_nothing_quickly() -> None:
    hostdeps.ensure_host_packages()
    t0 = time.monotonic()
    assert hostdeps.ensure_host_packages() == []
    assert time.monotonic() - t0 < 5
