"""`aenv node`: run this host's node agent, or look at and cordon the server's nodes.

`aenv node` alone runs the agent (`agentenv.node.agent`) until SIGTERM. `ls`, `cordon` and
`uncordon` talk to the server's `/nodes` routes with the client's URL and key.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

import typer

from agentenv.cli.connection import ClientError, _api, _guard
from agentenv.cli.output import emit

node_app = typer.Typer(
    help="Run this host's node agent (no subcommand), or list and cordon the server's nodes.",
    invoke_without_command=True,
)

COLUMNS = [
    ("NODE", "nodeID"),
    ("STATE", "state"),
    ("CPUS", "cpuCount"),
    ("MEMORY MB", "memoryMB"),
    ("FREE MB", "freeMemoryMB"),
    ("FREE SLOTS", "freeSlots"),
    ("RUNNING", "running"),
    ("PAUSED", "paused"),
    ("RPC", "rpcURL"),
    ("GATEWAY", "gateway"),
]


@node_app.callback()
def agent(ctx: typer.Context) -> None:
    """Without a subcommand: serve this host's sandboxes to the cluster (needs AGENTENV_ETCD,
    AGENTENV_NODE_TOKEN; AGENTENV_NODE_ID, AGENTENV_NODE_BIND, AGENTENV_NODE_URL,
    AGENTENV_NODE_GATEWAY_BIND, AGENTENV_NODE_GATEWAY_ADDR optional)."""
    if ctx.invoked_subcommand is not None:
        return
    from agentenv import __version__
    from agentenv.api.logs import configure as configure_logs
    from agentenv.cluster.etcd import ClusterUnavailable
    from agentenv.cluster.leases import DuplicateMember
    from agentenv.config import Settings
    from agentenv.config_env import ConfigError
    from agentenv.node.agent import run

    configure_logs("info", os.environ.get("AGENTENV_LOG_FORMAT", "text"))
    try:
        asyncio.run(run(Settings.from_env(), version=__version__))
    except (ConfigError, DuplicateMember, ClusterUnavailable) as exc:
        typer.echo(f"aenv node: {exc}", err=True)
        raise typer.Exit(1) from None


@node_app.command("ls")
def ls() -> None:
    """The server's nodes with their capacity and counts (a table, JSON when piped)."""
    rows: list[dict[str, Any]] = _guard(lambda: _api().call("GET", "/nodes").json())
    emit(rows, COLUMNS)


@node_app.command()
def cordon(
    node_id: str,
    reason: str = typer.Option("", "--reason", help="Why, shown in `aenv node ls`."),
) -> None:
    """Send no new sandboxes to NODE_ID; what runs there keeps running."""
    row = _guard(lambda: _api().call("POST", f"/nodes/{node_id}/cordon", json={"reason": reason}))
    emit([row.json()], COLUMNS)


@node_app.command()
def drain(node_id: str) -> None:
    """Cordon NODE_ID and pause every sandbox running there; none is lost, each resumes when
    asked. Fails (non-zero) if any could not be paused, naming them."""

    def run() -> dict[str, Any]:
        resp = _api().http.post(f"/nodes/{node_id}/drain", timeout=None)
        body: dict[str, Any] = resp.json()
        if resp.status_code >= 400 and "failed" not in body:
            raise ClientError(f"{body.get('message', resp.text)} (HTTP {resp.status_code})")
        return body

    body = _guard(run)
    emit([body["node"]], COLUMNS)
    typer.echo(f"paused: {' '.join(body['paused']) or 'none'}")
    if body["failed"]:
        for sandbox_id, why in body["failed"].items():
            typer.echo(f"not paused: {sandbox_id}: {why}", err=True)
        raise typer.Exit(1)


@node_app.command()
def uncordon(node_id: str) -> None:
    """Let NODE_ID take new sandboxes again."""
    row = _guard(lambda: _api().call("POST", f"/nodes/{node_id}/uncordon"))
    emit([row.json()], COLUMNS)


__all__ = ["ClientError", "node_app"]
