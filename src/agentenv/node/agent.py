"""`aenv node`: one host's sandboxes served to the cluster's control plane.

The agent is the node (`NodeRuntime`, the same one the single-node server runs in-process)
behind the node RPC (`agentenv.noderpc`), registered in etcd under a lease it keeps alive with
heartbeats that publish its capacity and load (`agentenv.cluster.membership`). A control
plane finds it there and places sandboxes on it; if the agent dies its lease lapses and the
cluster sees it gone. The templates this node holds a ready snapshot of are published as
locations under the same lease, so placement can prefer a node whose page cache is warm, and
its catalog templates (`cluster.catalog`), so replicas need no templates of their own.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import secrets
import signal
import ssl
from pathlib import Path
from urllib.parse import urlsplit

from agentenv.cluster.catalog import SharedCatalog, encode
from agentenv.cluster.etcd import Etcd
from agentenv.cluster.locations import Locations
from agentenv.cluster.membership import Capacity, Load, NodeInfo, NodeRegistration
from agentenv.cluster.tombstones import SnapshotTombstones
from agentenv.config import Settings
from agentenv.config_env import ConfigError
from agentenv.gateway.client import TLS_SCHEME
from agentenv.gateway.server import DataGateway
from agentenv.node.runtime import TEMPLATE_SOURCE, CatalogTemplates, NodeRuntime
from agentenv.noderpc.server import NodeServer

log = logging.getLogger(__name__)

# How often the agent looks for templates it has come to hold (or lost) to publish them.
LOCATIONS_EVERY_S = 10.0


def parse_bind(raw: str, name: str = "AGENTENV_NODE_BIND") -> tuple[str, int]:
    host, sep, port = raw.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ConfigError(f"{name}={raw!r}: expected HOST:PORT")
    return host.strip("[]"), int(port)


def server_tls(cert: Path, key: Path | None) -> ssl.SSLContext:
    """The gateway serves TLS with the node RPC's certificate."""
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(cert, key)
    return ctx


def instance_token(home: Path) -> str:
    """This data dir's agent identity (made once): a restart of the agent keeps it, another
    agent (another data dir) started with the same node id has another."""
    path = home / "node-instance"
    try:
        token = path.read_text().strip()
    except FileNotFoundError:
        token = ""
    if not token:
        token = secrets.token_hex(16)
        home.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(token + "\n")
        tmp.chmod(0o600)
        os.replace(tmp, path)
    return token


class NodeAgent:
    """Start with `start()`, end with `stop()` (paused sandboxes stay on disk)."""

    def __init__(self, settings: Settings, *, version: str = "") -> None:
        if not settings.etcd_endpoints:
            raise ConfigError("a node agent needs the cluster's etcd: set AGENTENV_ETCD")
        if not settings.node_token:
            raise ConfigError(
                "a node agent needs the cluster's node token: set AGENTENV_NODE_TOKEN"
            )
        self.settings = settings
        self.version = version
        self.runtime = NodeRuntime(settings)
        self.etcd = Etcd.from_settings(settings)
        host, port = parse_bind(settings.node_bind)
        rpc = settings.node_rpc
        self.server = NodeServer(
            self.runtime,
            host,
            port,
            settings.node_token,
            log_level="info",
            tls_cert=rpc.tls_cert,
            tls_key=rpc.tls_key,
        )
        # Made in `start` (its TLS files are read then, as the RPC server's are).
        self.gateway: DataGateway | None = None
        self._gateway_bind = (
            None
            if settings.node_gateway_bind == "off"
            else parse_bind(settings.node_gateway_bind, "AGENTENV_NODE_GATEWAY_BIND")
        )
        self.registration: NodeRegistration | None = None
        self._published: set[tuple[str, str]] = set()
        self._catalog = CatalogTemplates(settings)
        # An imported image is a new catalog template: published before the import answers.
        self.runtime.after_import = self._publish_once
        self._published_catalog: dict[str, bytes] = {}
        self._locations: asyncio.Task[None] | None = None
        self._bucket_gc: asyncio.Task[None] | None = None

    @property
    def node_id(self) -> str:
        return self.settings.node_id

    @property
    def url(self) -> str:
        return self.settings.node_url or self.server.url

    @property
    def gateway_addr(self) -> str:
        """What replicas dial for this node's guests ("" without a gateway)."""
        if self.gateway is None:
            return ""
        scheme = TLS_SCHEME if self.settings.node_rpc.serves_tls else ""
        if self.settings.node_gateway_addr:
            return scheme + self.settings.node_gateway_addr
        host = self.gateway.host
        if host in ("0.0.0.0", "::", ""):
            # Bound to every interface: dialled at the host the RPC is published at.
            host = urlsplit(self.url).hostname or "127.0.0.1"
        host = f"[{host}]" if ":" in host else host
        return f"{scheme}{host}:{self.gateway.port}"

    def _guest_address(self, sandbox_id: str) -> str | None:
        handle = self.runtime.node.running(sandbox_id)
        return None if handle is None else handle.address

    def load(self) -> Load:
        st = self.runtime.status(self.node_id)
        return Load(free_memory_mb=st.free_memory_mb, running=st.running, free_slots=st.free_slots)

    async def start(self) -> None:
        await self.runtime.start()
        try:
            await self.server.start()
            if self._gateway_bind is not None:
                rpc = self.settings.node_rpc
                assert self.settings.node_token is not None
                self.gateway = DataGateway(
                    *self._gateway_bind,
                    self.settings.node_token,
                    self._guest_address,
                    tls=server_tls(rpc.tls_cert, rpc.tls_key) if rpc.tls_cert else None,
                )
                await self.gateway.start()
                self.runtime.on_reset = self.gateway.cut_sandbox
            st = self.runtime.status(self.node_id)
            info = NodeInfo(
                node_id=self.node_id,
                rpc_url=self.url,
                address=urlsplit(self.url).hostname or "127.0.0.1",
                capacity=Capacity(cpus=st.cpus, memory_mb=st.memory_mb, slots=st.slots),
                load=self.load(),
                version=self.version,
                instance=await asyncio.to_thread(instance_token, self.settings.home),
                gateway=self.gateway_addr,
            )
            # Before it is a member: a snapshot deleted while it was away is not served again.
            await self._drop_deleted_snapshots()
            self.registration = NodeRegistration(
                self.etcd, info, ttl_s=self.settings.node_ttl_s, load_source=self.load
            )
            await self.registration.start()
            # Before the agent says it serves: a replica may create from `base` at once.
            await self._publish_once()
            self._locations = asyncio.create_task(self._publish_locations(), name="locations")
            if self.settings.bucket_gc_s > 0 and self.runtime.remote is not None:
                self._bucket_gc = asyncio.create_task(self._collect_bucket(), name="bucket-gc")
        except BaseException:
            await self.stop()
            raise
        log.info("node %s serving at %s, guests through %s", self.node_id, self.url,
                 self.gateway_addr or "their slot addresses")  # fmt: skip

    async def stop(self) -> None:
        for task in (self._locations, self._bucket_gc):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        self._locations = self._bucket_gc = None
        if self.registration is not None:
            # Leaving now: the cluster sees the node gone at once, not after its TTL.
            with contextlib.suppress(Exception):
                await self.registration.stop(deregister=True)
            self.registration = None
        await self.server.stop()
        if self.gateway is not None:
            await self.gateway.stop()
        await self.runtime.close()
        await self.etcd.close()

    def _held(self) -> set[tuple[str, str]]:
        """(kind, id) of what creates here restore from this node's disk: templates with a
        snapshot, and snapshots by id (a built template's, or one taken through the API)."""
        held: set[tuple[str, str]] = set()
        for snap in self.runtime.node.repo.list():
            if snap.source.startswith(TEMPLATE_SOURCE):
                held.add(("template", snap.source[len(TEMPLATE_SOURCE) :]))
            elif snap.names:
                held.add(("snapshot", snap.id))
        return held

    async def _publish_locations(self) -> None:
        while True:
            await asyncio.sleep(LOCATIONS_EVERY_S)
            try:
                await self._publish_once()
            except Exception as exc:
                log.warning("node %s: publishing template locations failed: %s", self.node_id, exc)

    async def _collect_bucket(self) -> None:
        """Every `bucket_gc_s` (at a random point of the first period, so agents started
        together do not all list the bucket at once): the bucket's unreferenced blobs go.
        Any node may do it; two at once delete the same blobs, which is harmless."""
        await asyncio.sleep(random.uniform(0.5, 1.0) * self.settings.bucket_gc_s)
        while True:
            remote = self.runtime.remote
            if remote is not None:
                try:
                    gone = await remote.gc_blobs()
                    if gone:
                        log.info("node %s: deleted %d unreferenced blobs from the bucket",
                                 self.node_id, len(gone))  # fmt: skip
                except Exception as exc:
                    log.warning("node %s: bucket garbage collection failed: %s", self.node_id, exc)
            await asyncio.sleep(self.settings.bucket_gc_s)

    async def _drop_deleted_snapshots(self) -> None:
        """Deletes this node's copies of snapshots the cluster deleted (tombstones): those it
        kept while it was down, or missed a delete of while it was unreachable."""
        deleted = await SnapshotTombstones(self.etcd).all()
        if not deleted:
            return
        held = {snap.id for snap in await asyncio.to_thread(self.runtime.node.repo.list)}
        for snapshot_id in sorted(held & deleted):
            try:
                await self.runtime.delete_snapshot(snapshot_id)
                log.info("node %s: deleted snapshot %s, deleted from the cluster while this "
                         "node was away", self.node_id, snapshot_id)  # fmt: skip
            except Exception as exc:
                log.warning("node %s: deleted snapshot %s is still here: %s",
                            self.node_id, snapshot_id, exc)  # fmt: skip

    async def _publish_once(self) -> None:
        """This node's template and snapshot locations and its catalog, as they are now."""
        assert self.registration is not None
        await self._drop_deleted_snapshots()
        locations = Locations(self.etcd, self.registration)
        held = await asyncio.to_thread(self._held)
        for kind, item in sorted(held - self._published):
            await locations.add(kind, item)
        for kind, item in sorted(self._published - held):
            await locations.remove(kind, item)
        self._published = held
        entries = {t.name: encode(t) for t in await asyncio.to_thread(self._catalog.catalog_infos)}
        self._published_catalog = await SharedCatalog(self.etcd).publish(
            self.registration, entries, self._published_catalog
        )


async def run(settings: Settings, *, version: str = "") -> None:
    """Run an agent until SIGTERM or SIGINT.

    The handlers are plain `signal.signal` ones, never `loop.add_signal_handler`: that sets a
    wakeup fd which a forked child inherits (pyroute2 forks to open netlink sockets in a slot's
    namespace and SIGTERMs the child when done), and a signal the child receives would then
    reach this loop as if this process had got it, and stop the agent. uvicorn (the RPC
    server) takes the signals while it runs and raises them again here once it has stopped."""
    agent = NodeAgent(settings, version=version)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_signal(_sig: int, _frame: object) -> None:
        loop.call_soon_threadsafe(stop.set)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    await agent.start()
    print(f"node {agent.node_id} serving at {agent.url}", flush=True)
    try:
        await stop.wait()
    finally:
        await agent.stop()
