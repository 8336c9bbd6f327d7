"""The node RPC over TLS on loopback: a throwaway CA (the `openssl` CLI) signs a certificate for
127.0.0.1, a `NodeServer` serves a `MemoryRuntime` with it, and `RemoteRuntime` clients with
the right CA, a wrong CA, the system store, or plain HTTP call it."""

from __future__ import annotations

import subprocess
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from pathlib import Path

import httpx
import pytest

from agentenv.config import NodeRpcConfig
from agentenv.noderpc.client import RemoteRuntime
from agentenv.noderpc.errors import NodeError, NodeUnreachable
from agentenv.noderpc.server import NodeServer

from .memruntime import MemoryRuntime
from .test_rpc import FAST, TOKEN

# Refusals must come well inside the client's deadlines, not by running into them.
REFUSAL_S = 4.0


@dataclass(frozen=True)
class Pki:
    ca: Path
    cert: Path
    key: Path
    other_ca: Path


def _openssl(*args: str | Path) -> None:
    subprocess.run(["openssl", *map(str, args)], check=True, capture_output=True, timeout=30)


def _make_ca(out: Path, name: str) -> tuple[Path, Path]:
    key, pem = out / f"{name}.key", out / f"{name}.pem"
    _openssl(
        "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
        "-keyout", key, "-out", pem, "-days", "2", "-subj", f"/CN={name}",
        "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign",
    )  # fmt: skip
    return pem, key


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    out = tmp_path_factory.mktemp("pki")
    ca, ca_key = _make_ca(out, "node-ca")
    other_ca, _ = _make_ca(out, "other-ca")
    key, csr, cert = out / "node.key", out / "node.csr", out / "node.pem"
    _openssl(
        "req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
        "-keyout", key, "-out", csr, "-subj", "/CN=127.0.0.1",
    )  # fmt: skip
    ext = out / "node.ext"
    ext.write_text(
        "basicConstraints=CA:FALSE\n"
        "keyUsage=critical,digitalSignature\n"
        "extendedKeyUsage=serverAuth\n"
        "subjectAltName=IP:127.0.0.1\n"
    )
    _openssl(
        "x509", "-req", "-in", csr, "-CA", ca, "-CAkey", ca_key, "-CAcreateserial",
        "-out", cert, "-days", "2", "-extfile", ext,
    )  # fmt: skip
    return Pki(ca=ca, cert=cert, key=key, other_ca=other_ca)


@pytest.fixture
async def tls_node(pki: Pki) -> AsyncIterator[tuple[MemoryRuntime, NodeServer]]:
    runtime = MemoryRuntime()
    server = NodeServer(
        runtime, "127.0.0.1", 0, TOKEN, heartbeat_s=0.2, tls_cert=pki.cert, tls_key=pki.key
    )
    await server.start()
    try:
        yield runtime, server
    finally:
        await server.stop()


def config_with(ca: Path | None) -> NodeRpcConfig:
    return replace(FAST, tls_ca=ca)


async def test_tls_server_publishes_https(tls_node: tuple[MemoryRuntime, NodeServer]) -> None:
    _, server = tls_node
    assert server.url == f"https://127.0.0.1:{server.port}"


def test_server_needs_cert_and_key(pki: Pki) -> None:
    with pytest.raises(ValueError, match="certificate and its key"):
        NodeServer(MemoryRuntime(), "127.0.0.1", 0, TOKEN, tls_cert=pki.cert)


async def test_client_with_the_ca_round_trips(
    pki: Pki, tls_node: tuple[MemoryRuntime, NodeServer]
) -> None:
    runtime, server = tls_node
    runtime.lose("rt-gone", "the host ran out of memory")
    remote = RemoteRuntime(server.url, TOKEN, config=config_with(pki.ca))
    await remote.start()
    try:
        assert await remote.lost_reason("rt-gone") == "the host ran out of memory"
        assert await remote.sandbox_ids() == []
    finally:
        await remote.close()


async def test_client_with_another_ca_is_refused(
    pki: Pki, tls_node: tuple[MemoryRuntime, NodeServer]
) -> None:
    runtime, server = tls_node
    remote = RemoteRuntime(server.url, TOKEN, config=config_with(pki.other_ca))
    await remote.start()
    try:
        began = time.monotonic()
        with pytest.raises(NodeUnreachable, match="certificate") as caught:
            await remote.sandbox_ids()
        assert time.monotonic() - began < REFUSAL_S
        assert server.url in str(caught.value)
    finally:
        await remote.close()
    # The handshake failed before any request reached the runtime.
    assert runtime.calls == []


async def test_https_without_a_ca_uses_the_system_store(
    tls_node: tuple[MemoryRuntime, NodeServer],
) -> None:
    # The throwaway CA is in no system store, so the node is refused: verification is on.
    _, server = tls_node
    remote = RemoteRuntime(server.url, TOKEN, config=config_with(None))
    await remote.start()
    try:
        began = time.monotonic()
        with pytest.raises(NodeUnreachable, match="certificate"):
            await remote.sandbox_ids()
        assert time.monotonic() - began < REFUSAL_S
    finally:
        await remote.close()


async def test_plain_http_to_the_tls_port_fails(
    pki: Pki, tls_node: tuple[MemoryRuntime, NodeServer]
) -> None:
    runtime, server = tls_node
    plain = f"http://127.0.0.1:{server.port}"
    remote = RemoteRuntime(plain, TOKEN, config=config_with(pki.ca))
    await remote.start()
    try:
        began = time.monotonic()
        with pytest.raises((NodeUnreachable, NodeError)):
            await remote.sandbox_ids()
        assert time.monotonic() - began < REFUSAL_S
    finally:
        await remote.close()
    # Another HTTP client gets no answer either: the port speaks only TLS.
    async with httpx.AsyncClient(timeout=REFUSAL_S, trust_env=False) as http:
        with pytest.raises(httpx.HTTPError):
            await http.post(
                f"{plain}/agentenv.node.v1.NodeService/SandboxIds",
                headers={"authorization": f"Bearer {TOKEN}", "content-type": "application/proto"},
            )
    assert runtime.calls == []


async def test_unreadable_ca_fails_at_start(tmp_path: Path) -> None:
    remote = RemoteRuntime(
        "https://127.0.0.1:9", TOKEN, config=config_with(tmp_path / "missing.pem")
    )
    with pytest.raises(NodeError, match="node CA"):
        await remote.start()
    await remote.close()
