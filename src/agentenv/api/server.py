"""`aenv serve`: build the app from Settings and run it on uvicorn."""

from __future__ import annotations

import asyncio
import os
import ssl
import sys
from pathlib import Path

import uvicorn

from agentenv.api.app import AgentenvApp
from agentenv.api.auth import api_key
from agentenv.api.keys import KeyRing, key_file
from agentenv.api.logs import configure as configure_logs
from agentenv.api.nodes import mount_nodes
from agentenv.config import Settings
from agentenv.config_env import ConfigError
from agentenv.contract.errors import SandboxNotFound
from agentenv.contract.nodes import NodeDirectory
from agentenv.contract.runtime import Runtime, TemplateSource
from agentenv.control.backend import open_store
from agentenv.control.metrics import Metrics
from agentenv.control.ownership import Replicas
from agentenv.control.sandboxes import SandboxManager
from agentenv.control.store import SandboxState, Store
from agentenv.gateway.client import GatewayDialer
from agentenv.guest import quiet_server

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000


def db_path(settings: Settings) -> Path:
    return settings.home / "agentenv.db"


def envd_version() -> str:
    from agentenv.guest.envd import ENVD_VERSION

    return ENVD_VERSION


def build_runtime(settings: Settings) -> tuple[Runtime, TemplateSource]:
    """The sandboxes' runtime: this host's node in-process (the single-node default), or, with
    `AGENTENV_ETCD`, the cluster's node agents over RPC (`cluster.runtime.ClusterRuntime`)."""
    from agentenv.build.state import BuildState, builds_dir
    from agentenv.build.templates import BuiltTemplates
    from agentenv.node.runtime import CatalogTemplates, NodeRuntime

    catalog = CatalogTemplates(settings)
    if settings.etcd_endpoints:
        from agentenv.build.shared_state import EtcdBuildState
        from agentenv.cluster.etcd import Etcd
        from agentenv.cluster.runtime import ClusterRuntime
        from agentenv.cluster.templates import ClusterTemplates
        from agentenv.objstore import ObjectStore

        if not settings.node_token:
            raise ConfigError("AGENTENV_ETCD is set: the node token (AGENTENV_NODE_TOKEN) too")
        # Built templates are records every replica shares (etcd, archives in the bucket);
        # snapshots taken on any node are created from by id (the cluster resolves them).
        etcd = Etcd.from_settings(settings)
        shared = EtcdBuildState(
            etcd, ObjectStore.from_settings(settings), builds_dir(settings.home)
        )
        cluster = ClusterRuntime(settings)
        # The runtime's catalog: mirrored, so resolving a template per create reads no etcd.
        source = ClusterTemplates(catalog, cluster.catalog, cluster.delete_snapshot)
        return cluster, BuiltTemplates(source, shared, catalog, shared=True)
    # Built templates (`name:tag`) first, then the catalog and snapshots.
    state = BuildState(builds_dir(settings.home), snapshot_lookup=catalog.snapshot_id)
    return NodeRuntime(settings), BuiltTemplates(catalog, state, catalog)


def build_replicas(settings: Settings) -> Replicas | None:
    """This replica's lease among the control-plane replicas sharing the store (etcd), whose
    ids stamp the rows each one is operating on; None on one server."""
    if not settings.etcd_endpoints:
        return None
    from agentenv.cluster.etcd import Etcd
    from agentenv.cluster.replicas import ReplicaLease

    return ReplicaLease(Etcd.from_settings(settings), ttl_s=settings.replica_ttl_s, owns_etcd=True)


def build_dialer(settings: Settings, manager: SandboxManager) -> GatewayDialer | None:
    """A replica's way to nodes' data gateways (token and CA of the node RPC); None on one
    server, whose guests are on its own host."""
    if not settings.etcd_endpoints or not settings.node_token:
        return None
    ca = settings.node_rpc.tls_ca
    tls = ssl.create_default_context(cafile=str(ca)) if ca else ssl.create_default_context()
    tunnels = manager.metrics.proxy_tunnels
    return GatewayDialer(
        settings.node_token, tls, on_tunnel=lambda gateway: tunnels.labels(gateway).inc()
    )


def node_directory(runtime: Runtime) -> NodeDirectory:
    """What `/nodes` lists: the cluster's members, or the one in-process node."""
    from agentenv.node.runtime import LocalNodes, NodeRuntime

    if isinstance(runtime, NodeRuntime):
        return LocalNodes(runtime)
    # Imported only where there is a cluster: it brings etcd's gRPC client and boto3, ~0.2 s
    # of CPU at every start of a single server.
    from agentenv.cluster.runtime import ClusterRuntime

    if isinstance(runtime, ClusterRuntime):
        return runtime
    raise TypeError(f"no node directory for {type(runtime).__name__}")


def build_app(
    settings: Settings,
    *,
    domain: str | None = None,
    store: Store | None = None,
) -> AgentenvApp:
    # etcd (shared by every replica) when AGENTENV_ETCD names members, else the SQLite file.
    store = store or open_store(settings, db_path(settings))
    rt, templates = build_runtime(settings)
    manager = SandboxManager(
        store,
        rt,
        templates,
        envd_version=envd_version(),
        metrics=Metrics(),
        default_cpu=settings.default_cpu,
        default_memory_mb=settings.default_memory_mb,
        max_cpu=settings.max_cpu,
        paused_retention_s=settings.paused_retention_s,
        timeout_grace_s=settings.timeout_grace_s,
        min_memory_mb=settings.min_memory_mb,
        max_memory_mb=settings.max_memory_mb,
        auto_resume=settings.auto_resume,
        shared=bool(settings.etcd_endpoints),
        replicas=build_replicas(settings),
        sweep_period_s=settings.sweep_period_s,
        sweep_grace_s=settings.sweep_grace_s,
    )
    app = AgentenvApp(
        manager, KeyRing(store), templates, domain=domain, dialer=build_dialer(settings, manager)
    )

    async def pause_running(sandbox_id: str) -> str | None:
        """A drain's step: pause the sandbox with its memory if it runs (through the state
        machine, as a client's pause would), else leave it."""
        try:
            rec = await manager.get(sandbox_id)
        except SandboxNotFound:
            return None
        if rec.state is not SandboxState.RUNNING:
            return None
        await manager.pause(sandbox_id)
        return "paused"

    mount_nodes(app.control, node_directory(rt), api_key, pause_running, metrics=manager.metrics)
    return app


async def _ensure_initial_key(settings: Settings) -> Path | None:
    """The first API key of a fresh store, written to `<home>/api-key`. On a store of its own,
    closed here: the server's store must be made in uvicorn's loop (an etcd client's channels
    belong to the loop that opened them)."""
    store = open_store(settings, db_path(settings))
    try:
        return await KeyRing(store).ensure_initial(settings.home)
    finally:
        await store.close()


def parse_bind(raw: str) -> tuple[str, int]:
    host, sep, port = raw.rpartition(":")
    if not sep or not host:
        raise ConfigError(f"AGENTENV_BIND={raw!r}: expected HOST:PORT")
    try:
        return host.strip("[]"), int(port)
    except ValueError as exc:
        raise ConfigError(f"AGENTENV_BIND={raw!r}: port is not a number") from exc


SHUTDOWN_GRACE_S = 10


def serve(
    host: str | None = None,
    port: int | None = None,
    *,
    certfile: Path | None = None,
    keyfile: Path | None = None,
    domain: str | None = None,
    log_level: str = "info",
) -> None:
    """Run the server until interrupted; prints the API key file on first start."""
    settings = Settings.from_env()
    if host is None or port is None:
        bind_host, bind_port = parse_bind(
            os.environ.get("AGENTENV_BIND", f"{DEFAULT_HOST}:{DEFAULT_PORT}")
        )
        host = host or bind_host
        port = port or bind_port
    if (certfile is None) != (keyfile is None):
        raise ConfigError("TLS needs both --cert and --key")
    configure_logs(log_level, os.environ.get("AGENTENV_LOG_FORMAT", "text"))
    settings.home.mkdir(parents=True, exist_ok=True)
    new_key = asyncio.run(_ensure_initial_key(settings))
    if new_key is not None:
        print(f"created the first API key; it is in {new_key} (mode 0600)", file=sys.stderr)
    else:
        print(
            f"API keys: `aenv keys ls`; the first key is in {key_file(settings.home)}",
            file=sys.stderr,
        )
    app = build_app(settings, domain=domain)
    scheme = "https" if certfile else "http"
    print(f"agentenv listening on {scheme}://{host}:{port}", file=sys.stderr)
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        ssl_certfile=str(certfile) if certfile else None,
        ssl_keyfile=str(keyfile) if keyfile else None,
        # HTTP/1.1 parsed in C (llhttp): every proxied request and every API call is parsed
        # here, and h11's pure-Python parser cost ~1 ms of the server's CPU per request.
        http="httptools",
        ws="websockets-sansio",
        # The SDK pools keep-alive sockets for up to 300 s.
        timeout_keep_alive=300,
        # Open streams (process output, watches) can last for hours: on SIGTERM they get
        # this long, then shutdown goes on (and releases every sandbox) without them.
        timeout_graceful_shutdown=SHUTDOWN_GRACE_S,
        log_level=log_level,
        access_log=False,
        lifespan="on",
    )
    quiet_server.Server(config).run()
