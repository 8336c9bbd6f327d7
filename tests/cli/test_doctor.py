"""`aenv doctor` names the accelerator the node would use and why."""

from __future__ import annotations

import subprocess
import sys

import pytest

from agentenv.config import Settings
from agentenv.vmm.accel import detect


def test_doctor_reports_the_detected_accelerator() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "agentenv.cli", "doctor"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    choice = detect(Settings.from_env())
    assert f"accelerator: {choice.name}" in proc.stderr, proc.stderr
    assert choice.reason.split()[0] in proc.stderr
    # Every line is either ok or a fix; the exit code says whether anything is missing.
    missing = proc.stderr.count(" fix ")
    assert (proc.returncode == 0) == (missing == 0), proc.stderr


def test_doctor_rejects_an_impossible_forced_accelerator() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "agentenv.cli", "doctor"],
        env={"AGENTENV_ACCEL": "warp", "PATH": "/usr/sbin:/usr/bin:/sbin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 1
    assert "AGENTENV_ACCEL" in proc.stderr


def _doctor(**env: str) -> subprocess.CompletedProcess[str]:
    import os

    return subprocess.run(
        [sys.executable, "-m", "agentenv.cli", "doctor"],
        env={**os.environ, "COLUMNS": "300", **env},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_doctor_reports_vmm_confinement_and_each_piece() -> None:
    from agentenv.vmm.confine import pieces

    proc = _doctor()
    assert "VMM confinement: on" in proc.stderr, proc.stderr
    for piece in pieces(Settings.from_env().qemu_binary):
        line = "ok   " if piece.ok else "fix  "
        assert f"{line}VMM confinement: {piece.name}" in proc.stderr, proc.stderr


def test_doctor_says_when_confinement_is_off() -> None:
    proc = _doctor(AGENTENV_CONFINE="off")
    assert "VMM confinement: off" in proc.stderr, proc.stderr
    assert "VMM confinement: command" not in proc.stderr


@pytest.mark.parametrize(
    ("env", "said", "bad"),
    [
        (
            {"AGENTENV_NET_RATE_MBIT": "20", "AGENTENV_SLOT_MAX_CONNECTIONS": "0"},
            ("network per sandbox: 20 Mbit/s each way", "no connection cap"),
            ("AGENTENV_NET_RATE_MBIT", "-3"),
        ),
        (
            {"AGENTENV_DISK_BPS_MB": "7", "AGENTENV_DISK_IOPS": "0"},
            ("disk IO per sandbox: 7 MiB/s", "no IO/s limit"),
            ("AGENTENV_DISK_IOPS", "-1"),
        ),
    ],
)
def test_doctor_reports_the_limits_in_effect(
    env: dict[str, str], said: tuple[str, ...], bad: tuple[str, str]
) -> None:
    proc = _doctor(**env)
    for text in said:
        assert text in proc.stderr, proc.stderr
    refused = _doctor(**{bad[0]: bad[1]})
    assert refused.returncode != 0 and f"{bad[0]}={bad[1]}" in refused.stderr, refused.stderr
