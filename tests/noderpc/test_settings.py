"""The node RPC's settings: token, deadlines and TLS from the environment."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path

import pytest

from agentenv.config import NodeRpcConfig, Settings
from agentenv.config_env import ConfigError
from agentenv.gateway.server import DataGateway
from agentenv.node.agent import NodeAgent
from agentenv.noderpc.client import RemoteRuntime
from agentenv.noderpc.server import serve

from .memruntime import MemoryRuntime
from .test_rpc import free_port


def test_defaults_leave_long_operations_room() -> None:
    cfg = NodeRpcConfig()
    # A create or resume under TCG takes 30-90 s, and may queue for a start slot first.
    assert cfg.long_s >= 180
    assert cfg.query_s < cfg.change_s < cfg.long_s


def test_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AGENTENV_NODE_TOKEN", "s3cret")
    monkeypatch.setenv("AGENTENV_NODE_RPC_TIMEOUT_S", "2.5")
    monkeypatch.setenv("AGENTENV_NODE_RPC_LONG_TIMEOUT_S", "600")
    settings = Settings.from_env()
    assert settings.node_token == "s3cret"
    assert "s3cret" not in repr(settings)
    assert settings.node_rpc == replace(NodeRpcConfig(), query_s=2.5, long_s=600.0)
    remote = RemoteRuntime.from_settings("http://127.0.0.1:7001", settings)
    assert remote.config == settings.node_rpc


@pytest.mark.parametrize("raw", ["soon", "0", "-1", "1e9"])
def test_bad_deadlines_are_refused(monkeypatch: pytest.MonkeyPatch, raw: str) -> None:
    monkeypatch.setenv("AGENTENV_NODE_RPC_CHANGE_TIMEOUT_S", raw)
    with pytest.raises(ConfigError, match="AGENTENV_NODE_RPC_CHANGE_TIMEOUT_S"):
        NodeRpcConfig.from_env()


def test_no_token_no_client(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("AGENTENV_NODE_TOKEN", raising=False)
    settings = replace(Settings.from_env(), home=tmp_path)
    assert settings.node_token is None
    with pytest.raises(ValueError, match="AGENTENV_NODE_TOKEN"):
        RemoteRuntime.from_settings("http://127.0.0.1:7001", settings)


async def test_serve_runs_until_cancelled() -> None:
    port = free_port()
    runtime = MemoryRuntime()
    task = asyncio.create_task(serve(runtime, "127.0.0.1", port, "tok"))
    remote = RemoteRuntime(f"http://127.0.0.1:{port}", "tok", timeout_s=2)
    await remote.start()
    try:
        async with asyncio.timeout(10):
            while True:
                try:
                    assert await remote.sandbox_ids() == []
                    break
                except Exception:  # not listening yet
                    await asyncio.sleep(0.05)
    finally:
        await remote.close()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    # Nothing listens there any more.
    with pytest.raises(ConnectionRefusedError):
        async with asyncio.timeout(5):
            await asyncio.open_connection("127.0.0.1", port)


def _pem_files(tmp_path: Path) -> tuple[Path, Path, Path]:
    # Settings only check the files exist; the TLS tests (test_tls.py) use real ones.
    cert, key, ca = tmp_path / "node.pem", tmp_path / "node.key", tmp_path / "ca.pem"
    for path in (cert, key, ca):
        path.write_text("-----BEGIN PLACEHOLDER-----\n")
    return cert, key, ca


def test_tls_from_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    cert, key, ca = _pem_files(tmp_path)
    monkeypatch.setenv("AGENTENV_NODE_TOKEN", "s3cret")
    monkeypatch.setenv("AGENTENV_NODE_TLS_CERT", str(cert))
    monkeypatch.setenv("AGENTENV_NODE_TLS_KEY", str(key))
    monkeypatch.setenv("AGENTENV_NODE_TLS_CA", str(ca))
    settings = Settings.from_env()
    rpc = settings.node_rpc
    assert (rpc.tls_cert, rpc.tls_key, rpc.tls_ca) == (cert, key, ca)
    assert rpc.serves_tls
    remote = RemoteRuntime.from_settings("https://127.0.0.1:7001", settings)
    assert remote.config.tls_ca == ca


def test_no_tls_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("AGENTENV_NODE_TLS_CERT", "AGENTENV_NODE_TLS_KEY", "AGENTENV_NODE_TLS_CA"):
        monkeypatch.delenv(name, raising=False)
    rpc = NodeRpcConfig.from_env()
    assert (rpc.tls_cert, rpc.tls_key, rpc.tls_ca) == (None, None, None)
    assert not rpc.serves_tls


@pytest.mark.parametrize("only", ["AGENTENV_NODE_TLS_CERT", "AGENTENV_NODE_TLS_KEY"])
def test_tls_cert_and_key_go_together(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, only: str
) -> None:
    for name in ("AGENTENV_NODE_TLS_CERT", "AGENTENV_NODE_TLS_KEY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(only, str(_pem_files(tmp_path)[0]))
    with pytest.raises(ConfigError) as caught:
        NodeRpcConfig.from_env()
    assert "AGENTENV_NODE_TLS_CERT" in str(caught.value)
    assert "AGENTENV_NODE_TLS_KEY" in str(caught.value)


@pytest.mark.parametrize("name", ["AGENTENV_NODE_TLS_CA", "AGENTENV_NODE_TLS_KEY"])
def test_tls_files_must_exist(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, name: str) -> None:
    cert, key, ca = _pem_files(tmp_path)
    monkeypatch.setenv("AGENTENV_NODE_TLS_CERT", str(cert))
    monkeypatch.setenv("AGENTENV_NODE_TLS_KEY", str(key))
    monkeypatch.setenv("AGENTENV_NODE_TLS_CA", str(ca))
    monkeypatch.setenv(name, str(tmp_path / "nowhere.pem"))
    with pytest.raises(ConfigError, match=f"{name}=.*not a file"):
        NodeRpcConfig.from_env()


def test_tls_node_url_must_be_https(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    cert, key, _ = _pem_files(tmp_path)
    monkeypatch.setenv("AGENTENV_NODE_TLS_CERT", str(cert))
    monkeypatch.setenv("AGENTENV_NODE_TLS_KEY", str(key))
    monkeypatch.setenv("AGENTENV_NODE_URL", "http://node-a:7100")
    with pytest.raises(ConfigError, match="AGENTENV_NODE_URL"):
        Settings.from_env()
    monkeypatch.setenv("AGENTENV_NODE_URL", "https://node-a:7100")
    assert Settings.from_env().node_url == "https://node-a:7100"


async def test_tls_agent_publishes_https(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    cert, key, _ = _pem_files(tmp_path)
    monkeypatch.setenv("AGENTENV_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("AGENTENV_ETCD", "127.0.0.1:1")  # never dialled: the agent is not started
    monkeypatch.setenv("AGENTENV_NODE_TOKEN", "s3cret")
    monkeypatch.setenv("AGENTENV_NODE_BIND", "127.0.0.1:0")
    monkeypatch.delenv("AGENTENV_NODE_URL", raising=False)
    monkeypatch.setenv("AGENTENV_NODE_TLS_CERT", str(cert))
    monkeypatch.setenv("AGENTENV_NODE_TLS_KEY", str(key))
    agent = NodeAgent(Settings.from_env())
    try:
        assert agent.url == f"https://127.0.0.1:{agent.server.port}"
    finally:
        await agent.server.stop()
    monkeypatch.delenv("AGENTENV_NODE_TLS_CERT")
    monkeypatch.delenv("AGENTENV_NODE_TLS_KEY")
    agent = NodeAgent(Settings.from_env())
    try:
        assert agent.url.startswith("http://127.0.0.1:")
    finally:
        await agent.server.stop()


def test_the_data_gateway_binds_beside_the_rpc_unless_told(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("AGENTENV_NODE_GATEWAY_BIND", raising=False)
    monkeypatch.delenv("AGENTENV_NODE_GATEWAY_ADDR", raising=False)
    monkeypatch.setenv("AGENTENV_NODE_BIND", "10.1.2.3:7100")
    assert Settings.from_env().node_gateway_bind == "10.1.2.3:0"
    monkeypatch.setenv("AGENTENV_NODE_GATEWAY_BIND", "0.0.0.0:7101")
    monkeypatch.setenv("AGENTENV_NODE_GATEWAY_ADDR", "node-a.example:7101")
    settings = Settings.from_env()
    assert (settings.node_gateway_bind, settings.node_gateway_addr) == (
        "0.0.0.0:7101",
        "node-a.example:7101",
    )
    monkeypatch.setenv("AGENTENV_NODE_GATEWAY_BIND", "off")
    assert Settings.from_env().node_gateway_bind == "off"
    for bad in ("7101", "host:", "host:99999", "host:port"):
        monkeypatch.setenv("AGENTENV_NODE_GATEWAY_BIND", bad)
        with pytest.raises(ConfigError, match="AGENTENV_NODE_GATEWAY_BIND"):
            Settings.from_env()


async def test_an_agent_publishes_its_gateway_with_tls_when_its_rpc_has_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("AGENTENV_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("AGENTENV_ETCD", "127.0.0.1:1")  # never dialled: not started
    monkeypatch.setenv("AGENTENV_NODE_TOKEN", "s3cret")
    monkeypatch.setenv("AGENTENV_NODE_BIND", "0.0.0.0:0")
    monkeypatch.setenv("AGENTENV_NODE_URL", "http://node-a.example:7100")
    monkeypatch.delenv("AGENTENV_NODE_GATEWAY_BIND", raising=False)
    monkeypatch.delenv("AGENTENV_NODE_GATEWAY_ADDR", raising=False)
    agent = NodeAgent(Settings.from_env())
    assert agent.gateway_addr == ""  # not started: no gateway yet
    agent.gateway = DataGateway("0.0.0.0", 7101, "s3cret", lambda _: None)
    # Bound to every interface: published at the host replicas call the RPC at.
    assert agent.gateway_addr == "node-a.example:7101"
    monkeypatch.setenv("AGENTENV_NODE_GATEWAY_ADDR", "gw.example:9")
    cert, key, _ = _pem_files(tmp_path)
    monkeypatch.setenv("AGENTENV_NODE_TLS_CERT", str(cert))
    monkeypatch.setenv("AGENTENV_NODE_TLS_KEY", str(key))
    monkeypatch.setenv("AGENTENV_NODE_URL", "https://node-a.example:7100")
    agent = NodeAgent(Settings.from_env())
    agent.gateway = DataGateway("0.0.0.0", 7101, "s3cret", lambda _: None)
    assert agent.gateway_addr == "tls://gw.example:9"
