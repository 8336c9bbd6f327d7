"""The settings that configure the cluster client, and key naming (no etcd needed)."""

from __future__ import annotations

import pytest

from agentenv.cluster.etcd import Etcd
from agentenv.config import Settings
from agentenv.config_env import ConfigError


def test_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AGENTENV_ETCD", raising=False)
    monkeypatch.delenv("AGENTENV_NODE_TTL_S", raising=False)
    monkeypatch.delenv("AGENTENV_NODE_RECONCILE_S", raising=False)
    monkeypatch.delenv("AGENTENV_BUCKET_GC_S", raising=False)
    settings = Settings.from_env()
    assert settings.etcd_endpoints == () and settings.node_ttl_s == 10
    assert settings.node_reconcile_s == 30 and settings.bucket_gc_s == 3600
    assert settings.etcd_prefix == "/agentenv/"
    monkeypatch.setenv("AGENTENV_ETCD", " 127.0.0.1:2379, http://etcd-2:2380/ ,")
    monkeypatch.setenv("AGENTENV_ETCD_PREFIX", "/other/")
    monkeypatch.setenv("AGENTENV_NODE_TTL_S", "4")
    monkeypatch.setenv("AGENTENV_NODE_RECONCILE_S", "5")
    monkeypatch.setenv("AGENTENV_BUCKET_GC_S", "0")
    settings = Settings.from_env()
    assert settings.bucket_gc_s == 0
    assert settings.etcd_endpoints == ("127.0.0.1:2379", "etcd-2:2380")
    assert settings.node_ttl_s == 4 and settings.node_reconcile_s == 5
    etcd = Etcd.from_settings(settings)
    assert etcd.endpoints == settings.etcd_endpoints and etcd.prefix == "/other/"
    for name, bad in (
        ("AGENTENV_ETCD", "127.0.0.1"),
        ("AGENTENV_ETCD", "host:notaport"),
        ("AGENTENV_NODE_TTL_S", "1"),
        ("AGENTENV_NODE_RECONCILE_S", "0"),
        ("AGENTENV_BUCKET_GC_S", "-1"),
        ("AGENTENV_ETCD_PREFIX", "agentenv"),
    ):
        with monkeypatch.context() as scoped:
            scoped.setenv(name, bad)
            with pytest.raises(ConfigError, match=name):
                Settings.from_env()


def test_keys_are_names_not_paths() -> None:
    etcd = Etcd("127.0.0.1:1", prefix="/p/")
    assert etcd.key("nodes", "a") == b"/p/nodes/a"
    assert etcd.dir("nodes") == b"/p/nodes/"
    for bad in ("", "a/b"):
        with pytest.raises(ValueError):
            etcd.key("nodes", bad)
    with pytest.raises(ValueError):
        Etcd("")


def test_replica_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("AGENTENV_REPLICA_TTL_S", "AGENTENV_SWEEP_PERIOD_S", "AGENTENV_SWEEP_GRACE_S"):
        monkeypatch.delenv(name, raising=False)
    settings = Settings.from_env()
    assert (settings.replica_ttl_s, settings.sweep_period_s, settings.sweep_grace_s) == (10, 2, 5)
    monkeypatch.setenv("AGENTENV_REPLICA_TTL_S", "4")
    monkeypatch.setenv("AGENTENV_SWEEP_PERIOD_S", "1")
    monkeypatch.setenv("AGENTENV_SWEEP_GRACE_S", "0")
    settings = Settings.from_env()
    assert (settings.replica_ttl_s, settings.sweep_period_s, settings.sweep_grace_s) == (4, 1, 0)
    for name, bad in (
        ("AGENTENV_REPLICA_TTL_S", "1"),
        ("AGENTENV_SWEEP_PERIOD_S", "0"),
        ("AGENTENV_SWEEP_GRACE_S", "-1"),
        ("AGENTENV_SWEEP_GRACE_S", "soon"),
    ):
        with monkeypatch.context() as scoped:
            scoped.setenv(name, bad)
            with pytest.raises(ConfigError, match=name):
                Settings.from_env()
