"""`aenv serve`: build the app from Settings and run it on uvicorn."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import uvicorn

from agentenv.api.app import AgentenvApp
from agentenv.api.keys import KeyRing, key_file
from agentenv.api.logs import configure as configure_logs
from agentenv.config import ConfigError, Settings
from agentenv.contract.runtime import Runtime, TemplateSource
from agentenv.control.metrics import Metrics
from agentenv.control.sandboxes import SandboxManager
from agentenv.control.store import Store

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000


def db_path(settings: Settings) -> Path:
    return settings.home / "agentenv.db"


def envd_version() -> str:
    from agentenv.guest.envd import ENVD_VERSION

    return ENVD_VERSION


def build_runtime(settings: Settings) -> tuple[Runtime, TemplateSource]:
    from agentenv.build.state import BuildState, builds_dir
    from agentenv.build.templates import BuiltTemplates
    from agentenv.node.runtime import CatalogTemplates, NodeRuntime

    catalog = CatalogTemplates(settings)
    # Built templates (`name:tag`) first, then the catalog and snapshots.
    built = BuiltTemplates(catalog, BuildState(builds_dir(settings.home)), catalog.repo)
    return NodeRuntime(settings), built


def build_app(
    settings: Settings,
    *,
    domain: str | None = None,
    store: Store | None = None,
) -> AgentenvApp:
    store = store or Store(db_path(settings))
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
        min_memory_mb=settings.min_memory_mb,
        max_memory_mb=settings.max_memory_mb,
        auto_resume=settings.auto_resume,
    )
    return AgentenvApp(manager, KeyRing(store), templates, domain=domain)


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
    store = Store(db_path(settings))
    new_key = KeyRing(store).ensure_initial(settings.home)
    if new_key is not None:
        print(f"created the first API key; it is in {new_key} (mode 0600)", file=sys.stderr)
    else:
        print(
            f"API keys: `aenv keys ls`; the first key is in {key_file(settings.home)}",
            file=sys.stderr,
        )
    app = build_app(settings, domain=domain, store=store)
    scheme = "https" if certfile else "http"
    print(f"agentenv listening on {scheme}://{host}:{port}", file=sys.stderr)
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        ssl_certfile=str(certfile) if certfile else None,
        ssl_keyfile=str(keyfile) if keyfile else None,
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
    uvicorn.Server(config).run()
