"""Settings from the environment: defaults, overrides and clear errors."""

from __future__ import annotations

import ipaddress
import os

import pytest

from agentenv.config import Settings
from agentenv.config_env import ConfigError


def test_defaults_stay_out_of_rfc1918(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("AGENTENV_GUEST_CIDR", "AGENTENV_SLOT_CIDR"):
        monkeypatch.delenv(name, raising=False)
    net = Settings.from_env().network
    private = [ipaddress.IPv4Network(n) for n in ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16")]
    for ours in (net.guest_cidr, net.slot_cidr):
        assert not any(ours.overlaps(p) for p in private)
    assert net.guest_ip in net.guest_cidr and net.gateway_ip in net.guest_cidr


def test_dns_override(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AGENTENV_DNS", "198.51.100.53, 198.51.100.54")
    assert Settings.from_env().dns == ("198.51.100.53", "198.51.100.54")
    monkeypatch.setenv("AGENTENV_DNS", "127.0.0.1:5353")
    assert Settings.from_env().dns == ("127.0.0.1:5353",)
    monkeypatch.setenv("AGENTENV_DNS", "")
    assert Settings.from_env().dns == ()


def test_auto_resume_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    # Off unless set, as E2B: only sandboxes created with autoResume enabled wake on traffic.
    monkeypatch.delenv("AGENTENV_AUTO_RESUME", raising=False)
    assert Settings.from_env().auto_resume is False
    for raw, expected in (("0", False), ("false", False), ("1", True), ("TRUE", True)):
        monkeypatch.setenv("AGENTENV_AUTO_RESUME", raw)
        assert Settings.from_env().auto_resume is expected


def test_warm_watermarks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AGENTENV_WARM_LOW", raising=False)
    monkeypatch.delenv("AGENTENV_WARM_HIGH", raising=False)
    s = Settings.from_env()
    assert (s.warm_low, s.warm_high) == (1, 2)
    monkeypatch.setenv("AGENTENV_WARM_LOW", "0")
    monkeypatch.setenv("AGENTENV_WARM_HIGH", "3")
    s = Settings.from_env()
    assert (s.warm_low, s.warm_high) == (0, 3)


def test_admission_limits(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("MAX_SANDBOXES", "MAX_STARTS", "START_QUEUE", "MIN_FREE_MEMORY_MB"):
        monkeypatch.delenv(f"AGENTENV_{name}", raising=False)
    monkeypatch.delenv("AGENTENV_MIN_FREE_DISK_MB", raising=False)
    s = Settings.from_env()
    assert (s.max_sandboxes, s.start_queue) == (0, 128)
    assert s.max_starts == max(2, os.cpu_count() or 1)
    assert (s.min_free_memory_mb, s.min_free_disk_mb) == (256, 1024)
    monkeypatch.setenv("AGENTENV_MAX_SANDBOXES", "32")
    monkeypatch.setenv("AGENTENV_MAX_STARTS", "1")
    monkeypatch.setenv("AGENTENV_START_QUEUE", "0")
    monkeypatch.setenv("AGENTENV_MIN_FREE_DISK_MB", "0")
    s = Settings.from_env()
    assert (s.max_sandboxes, s.max_starts, s.start_queue, s.min_free_disk_mb) == (32, 1, 0, 0)


@pytest.mark.parametrize(
    ("name", "value", "needle"),
    [
        ("AGENTENV_DNS", "resolver.example", "AGENTENV_DNS"),
        ("AGENTENV_SLOT_CIDR", "198.18.0.0/31", "too small"),
        ("AGENTENV_GUEST_CIDR", "not-a-net", "AGENTENV_GUEST_CIDR"),
        ("AGENTENV_ACCEL", "warp", "kvm, pvm or tcg"),
        ("AGENTENV_BOOT_TIMEOUT", "soon", "AGENTENV_BOOT_TIMEOUT"),
        ("AGENTENV_AUTO_RESUME", "yes", "AGENTENV_AUTO_RESUME"),
        ("AGENTENV_WARM_LOW", "3", "expected 0 <= low <= high"),
        ("AGENTENV_WARM_HIGH", "-1", "AGENTENV_WARM_HIGH=-1"),
        ("AGENTENV_WARM_LOW", "many", "AGENTENV_WARM_LOW"),
        ("AGENTENV_MAX_STARTS", "0", "AGENTENV_MAX_STARTS=0: expected 1 or more"),
        ("AGENTENV_MAX_SANDBOXES", "-1", "AGENTENV_MAX_SANDBOXES=-1"),
        ("AGENTENV_START_QUEUE", "lots", "AGENTENV_START_QUEUE"),
        ("AGENTENV_MIN_FREE_MEMORY_MB", "-5", "AGENTENV_MIN_FREE_MEMORY_MB=-5"),
        ("AGENTENV_MIN_FREE_DISK_MB", "-5", "AGENTENV_MIN_FREE_DISK_MB=-5"),
        ("AGENTENV_DISK_BPS_MB", "-1", "AGENTENV_DISK_BPS_MB=-1: expected 0 or more"),
        ("AGENTENV_DISK_BPS_MB", "fast", "AGENTENV_DISK_BPS_MB='fast' is not an integer"),
        ("AGENTENV_DISK_BPS_MB", str(10**12), "AGENTENV_DISK_BPS_MB=.*at most"),
        ("AGENTENV_DISK_IOPS", "-3", "AGENTENV_DISK_IOPS=-3"),
        ("AGENTENV_DISK_IOPS", str(10**16), "AGENTENV_DISK_IOPS=.*at most"),
    ],
)
def test_bad_values_are_named(
    monkeypatch: pytest.MonkeyPatch, name: str, value: str, needle: str
) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match=needle):
        Settings.from_env()


def test_vmm_confinement_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    # On unless the operator turns it off explicitly.
    monkeypatch.delenv("AGENTENV_CONFINE", raising=False)
    assert Settings.from_env().confine is True
    for raw, expected in (("off", False), ("0", False), ("ON", True), ("1", True)):
        monkeypatch.setenv("AGENTENV_CONFINE", raw)
        assert Settings.from_env().confine is expected
    monkeypatch.setenv("AGENTENV_CONFINE", "maybe")
    with pytest.raises(ConfigError, match="AGENTENV_CONFINE"):
        Settings.from_env()


def test_disk_limits(monkeypatch: pytest.MonkeyPatch) -> None:
    from agentenv.snapshot.machine import disk_limits
    from agentenv.vmm.base import DiskLimits

    for name in ("AGENTENV_DISK_BPS_MB", "AGENTENV_DISK_IOPS"):
        monkeypatch.delenv(name, raising=False)
    settings = Settings.from_env()
    assert (settings.disk_bps_mb, settings.disk_iops) == (100, 2000)
    assert disk_limits(settings) == DiskLimits(100 * 1024 * 1024, 2000)
    monkeypatch.setenv("AGENTENV_DISK_BPS_MB", "5")
    monkeypatch.setenv("AGENTENV_DISK_IOPS", "0")
    assert disk_limits(Settings.from_env()) == DiskLimits(5 * 1024 * 1024, 0)
    # Both off: no throttling at all (QEMU is never asked).
    monkeypatch.setenv("AGENTENV_DISK_BPS_MB", "0")
    assert disk_limits(Settings.from_env()) is None


def test_object_store_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (
        "AGENTENV_S3_ENDPOINT", "AGENTENV_S3_BUCKET", "AGENTENV_S3_ACCESS_KEY",
        "AGENTENV_S3_SECRET_KEY", "AGENTENV_S3_REGION", "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY", "AWS_REGION", "AGENTENV_BLOB_CACHE_MB",
    ):  # fmt: skip
        monkeypatch.delenv(name, raising=False)
    assert Settings.from_env().object_store is None  # single node: no object storage
    assert Settings.from_env().blob_cache_mb == 20480
    monkeypatch.setenv("AGENTENV_S3_ENDPOINT", "http://127.0.0.1:8333")
    with pytest.raises(ConfigError, match="go together"):
        Settings.from_env()
    monkeypatch.setenv("AGENTENV_S3_BUCKET", "snaps")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AK")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "SK")
    cfg = Settings.from_env().object_store
    assert cfg is not None and (cfg.bucket, cfg.access_key, cfg.region) == (
        "snaps",
        "AK",
        "us-east-1",
    )
    assert "SK" not in repr(cfg)
    monkeypatch.setenv("AGENTENV_S3_ACCESS_KEY", "mine")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    with pytest.raises(ConfigError, match="secret"):
        Settings.from_env()
    monkeypatch.setenv("AGENTENV_S3_SECRET_KEY", "s")
    monkeypatch.setenv("AGENTENV_BLOB_CACHE_MB", "512")
    settings = Settings.from_env()
    assert settings.object_store is not None and settings.object_store.access_key == "mine"
    assert settings.blob_cache_mb == 512
    monkeypatch.setenv("AGENTENV_S3_ENDPOINT", "127.0.0.1:8333")
    with pytest.raises(ConfigError, match="http"):
        Settings.from_env()


def test_boot_timeout_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AGENTENV_BOOT_TIMEOUT", "0")
    assert Settings.from_env().boot_timeout_s is None
    monkeypatch.setenv("AGENTENV_BOOT_TIMEOUT", "45")
    assert Settings.from_env().boot_timeout_s == 45.0
    monkeypatch.setenv("AGENTENV_BOOT_TIMEOUT", "-1")
    with pytest.raises(ConfigError, match="AGENTENV_BOOT_TIMEOUT=-1"):
        Settings.from_env()
