"""The node RPC's settings: token and deadlines from the environment."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path

import pytest

from agentenv.config import ConfigError, NodeRpcConfig, Settings
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
