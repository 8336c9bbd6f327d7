"""`aenv doctor` names the accelerator the node would use and why."""

from __future__ import annotations

import subprocess
import sys

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


def test_doctor_reports_the_network_limits_in_effect() -> None:
    proc = _doctor(AGENTENV_NET_RATE_MBIT="20", AGENTENV_SLOT_MAX_CONNECTIONS="0")
    assert "network per sandbox: 20 Mbit/s each way" in proc.stderr, proc.stderr
    assert "no connection cap" in proc.stderr, proc.stderr
    bad = _doctor(AGENTENV_NET_RATE_MBIT="-3")
    assert bad.returncode != 0 and "AGENTENV_NET_RATE_MBIT=-3" in bad.stderr, bad.stderr


def test_doctor_reports_the_disk_limits_in_effect() -> None:
    proc = _doctor(AGENTENV_DISK_BPS_MB="7", AGENTENV_DISK_IOPS="0")
    assert "disk IO per sandbox: 7 MiB/s" in proc.stderr, proc.stderr
    assert "no IO/s limit" in proc.stderr, proc.stderr
    bad = _doctor(AGENTENV_DISK_IOPS="lots")
    assert bad.returncode != 0 and "AGENTENV_DISK_IOPS" in bad.stderr, bad.stderr
