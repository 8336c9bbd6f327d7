"""Host package checks against the real dpkg database."""

from __future__ import annotations

import time

import pytest

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


def test_test_commands_install_only_the_missing_commands_packages(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    asked: list[list[str]] = []
    monkeypatch.setattr(hostdeps, "_apt_install", lambda pkgs, progress: asked.append(pkgs))
    monkeypatch.setattr(hostdeps.shutil, "which", lambda cmd: None if cmd == "npm" else "/x")
    assert hostdeps.ensure_test_commands() == ["npm"]
    assert asked == [["npm"]]
    monkeypatch.setattr(hostdeps.shutil, "which", lambda cmd: "/usr/bin/" + cmd)
    assert hostdeps.ensure_test_commands() == []
    assert asked == [["npm"]]
