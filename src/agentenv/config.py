"""Settings shared by every component, read from the environment with embedded defaults.

Every knob has a default that works on a fresh Debian host, so `aenv serve` needs no config
file. Environment variables (``AGENTENV_*``) override the defaults; tests point ``home`` at a
temporary directory and keep the shared build ``cache``.

How a variable's text becomes a value (and `ConfigError`) is `config_env`.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from dataclasses import dataclass, field, replace
from pathlib import Path

from agentenv.config_env import (
    ConfigError,
    boot_timeout_from_env,
    default_cache,
    default_max_starts,
    dns_servers_from_env,
    env_bool,
    env_bounded,
    env_int,
    env_opt_path,
    env_path,
    env_switch,
    etcd_endpoints_from_env,
    gateway_bind_from_env,
    parse_net,
    parse_node_id,
)

# The guest side of every network slot is identical, so a snapshot taken in one slot restores
# into any other. Link-local space keeps it clear of every routed and RFC 1918 network.
DEFAULT_GUEST_CIDR = "169.254.0.0/30"
# Host-side slot addresses come from the benchmarking range (RFC 2544), never RFC 1918.
DEFAULT_SLOT_CIDR = "198.18.0.0/15"
DEFAULT_GUEST_MAC = "02:ae:00:00:00:02"
# And the host side of it, the slot's tap (the guest's gateway): a restored guest's ARP cache
# holds the MAC of the tap its snapshot was taken behind. With a tap MAC of its own per slot,
# the guest's replies went to the old MAC (dropped) until the host happened to ARP for the
# guest once it ran: up to ~5 s more per restore under load (a reset's envd wait: 6.5 s).
GATEWAY_MAC = "02:ae:00:00:00:01"
# tbf's rate field is 32-bit bytes/s (about 34 Gbit/s); a slot's conntrack cap stays below
# what a host's table holds by default.
MAX_NET_RATE_MBIT = 32000
MAX_SLOT_CONNECTIONS = 262144
# Largest disk throttle values QEMU takes (`THROTTLE_VALUE_MAX`, 10^15 per second).
MAX_DISK_LIMIT = {"AGENTENV_DISK_BPS_MB": 10**15 // 2**20, "AGENTENV_DISK_IOPS": 10**15}


@dataclass(frozen=True)
class NetworkPlan:
    """Address plan for network slots."""

    guest_cidr: ipaddress.IPv4Network = field(
        default_factory=lambda: ipaddress.IPv4Network(DEFAULT_GUEST_CIDR)
    )
    slot_cidr: ipaddress.IPv4Network = field(
        default_factory=lambda: ipaddress.IPv4Network(DEFAULT_SLOT_CIDR)
    )
    guest_mac: str = DEFAULT_GUEST_MAC
    # Per slot, each way (tbf toward the guest, an nft policer from it), in Mbit/s; and the
    # connections a guest may have open at once (`ct count`), so one guest cannot fill the
    # conntrack table. 0 = no limit.
    rate_mbit: int = 200
    max_connections: int = 4096

    @property
    def gateway_ip(self) -> ipaddress.IPv4Address:
        """Address of the tap inside each slot's namespace (the guest's default route)."""
        return self.guest_cidr.network_address + 1

    @property
    def guest_ip(self) -> ipaddress.IPv4Address:
        return self.guest_cidr.network_address + 2

    @property
    def max_slots(self) -> int:
        # One /30 per slot: host end, namespace end.
        return self.slot_cidr.num_addresses // 4


@dataclass(frozen=True)
class ObjectStoreConfig:
    """An S3 bucket that holds templates and paused sandboxes (`agentenv.objstore`), so any
    node can create from or resume what another node captured."""

    endpoint: str
    bucket: str
    access_key: str | None = None
    secret_key: str | None = field(default=None, repr=False)
    region: str = "us-east-1"

    @classmethod
    def from_env(cls) -> ObjectStoreConfig | None:
        """`AGENTENV_S3_ENDPOINT` + `AGENTENV_S3_BUCKET`, both or neither (None: no object
        storage, the single-node default). Keys: `AGENTENV_S3_ACCESS_KEY` /
        `AGENTENV_S3_SECRET_KEY`, else the standard `AWS_ACCESS_KEY_ID` /
        `AWS_SECRET_ACCESS_KEY`."""
        endpoint = os.environ.get("AGENTENV_S3_ENDPOINT", "").strip()
        bucket = os.environ.get("AGENTENV_S3_BUCKET", "").strip()
        if not endpoint and not bucket:
            return None
        if not endpoint or not bucket:
            raise ConfigError(
                "AGENTENV_S3_ENDPOINT and AGENTENV_S3_BUCKET go together (set both or neither)"
            )
        if not endpoint.startswith(("http://", "https://")):
            raise ConfigError(f"AGENTENV_S3_ENDPOINT={endpoint!r}: expected an http(s) URL")
        access = os.environ.get("AGENTENV_S3_ACCESS_KEY") or os.environ.get("AWS_ACCESS_KEY_ID")
        secret = os.environ.get("AGENTENV_S3_SECRET_KEY") or os.environ.get("AWS_SECRET_ACCESS_KEY")
        if (access is None) != (secret is None):
            raise ConfigError("an S3 access key needs its secret key (and the other way round)")
        region = os.environ.get("AGENTENV_S3_REGION") or os.environ.get("AWS_REGION") or "us-east-1"
        return cls(endpoint, bucket, access, secret, region)


@dataclass(frozen=True)
class NodeRpcConfig:
    """Deadlines of the control plane's calls to a node agent (`agentenv.noderpc`), seconds.

    `query_s`: lookups (find, is_alive, lists, health); `change_s`: delete and egress
    updates; `long_s`: create, resume, pause, snapshot and fork, which under TCG take 30-90 s
    and may wait in the node's start queue first. `retry_after_s` is the Retry-After the API
    gives when a node does not answer.

    TLS: a node agent given `tls_cert` and `tls_key` (PEM files) serves HTTPS and publishes
    an `https://` URL; a replica verifies a node's certificate against `tls_ca` (a PEM bundle)
    when set, else against the system store. Verification is never turned off.
    """

    query_s: float = 10.0
    change_s: float = 60.0
    long_s: float = 300.0
    connect_s: float = 5.0
    retry_after_s: int = 5
    tls_cert: Path | None = None
    tls_key: Path | None = None
    tls_ca: Path | None = None

    @property
    def serves_tls(self) -> bool:
        return self.tls_cert is not None

    @classmethod
    def from_env(cls) -> NodeRpcConfig:
        values: dict[str, float] = {}
        for attr, name in (
            ("query_s", "AGENTENV_NODE_RPC_TIMEOUT_S"),
            ("change_s", "AGENTENV_NODE_RPC_CHANGE_TIMEOUT_S"),
            ("long_s", "AGENTENV_NODE_RPC_LONG_TIMEOUT_S"),
            ("connect_s", "AGENTENV_NODE_RPC_CONNECT_TIMEOUT_S"),
        ):
            raw = os.environ.get(name, "").strip()
            if not raw:
                continue
            try:
                value = float(raw)
            except ValueError as exc:
                raise ConfigError(f"{name}={raw!r} is not a number of seconds") from exc
            if not 0 < value <= 24 * 3600:
                raise ConfigError(f"{name}={raw!r}: expected more than 0 and at most a day")
            values[attr] = value
        cert = env_opt_path("AGENTENV_NODE_TLS_CERT")
        key = env_opt_path("AGENTENV_NODE_TLS_KEY")
        if (cert is None) != (key is None):
            raise ConfigError(
                "AGENTENV_NODE_TLS_CERT and AGENTENV_NODE_TLS_KEY go together: set both or neither"
            )
        ca = env_opt_path("AGENTENV_NODE_TLS_CA")
        for name, path in (
            ("AGENTENV_NODE_TLS_CERT", cert),
            ("AGENTENV_NODE_TLS_KEY", key),
            ("AGENTENV_NODE_TLS_CA", ca),
        ):
            # Checked here so a typo stops the process at start, not at the first call.
            if path is not None and not path.is_file():
                raise ConfigError(f"{name}={str(path)!r} is not a file")
        return cls(**values, tls_cert=cert, tls_key=key, tls_ca=ca)  # type: ignore[arg-type]


@dataclass(frozen=True)
class Settings:
    """Where things live and how sandboxes are shaped."""

    home: Path
    cache: Path
    kernel: Path | None = None
    initramfs: Path | None = None
    accel: str | None = None
    # TCG's translated-code cache per VM, MiB (vmm.accel): 128 measured ~9% less QEMU CPU than
    # 64 for a template build, which fills the smaller one, and the same memory for an idle clone.
    tcg_tb_size_mb: int = 128
    pvm_kernel: Path | None = None
    qemu_binary: str = "qemu-system-x86_64"
    network: NetworkPlan = field(default_factory=NetworkPlan)
    default_cpu: int = 1
    default_memory_mb: int = 512
    min_memory_mb: int = 128
    max_memory_mb: int = 16384
    max_cpu: int = 8
    # Network slots: `low` built ahead at start (and refilled in the background), up to
    # `high` released ones kept for reuse. A reuse costs ~1 ms of the host's CPU where a new
    # slot costs ~15 and its teardown ~3 (netlink, nft, the namespace): the larger part of a
    # create's host CPU after the restore itself (#23). An idle slot holds a namespace, a
    # veth pair and a tap; a restart removes what a crash left (`recover_slots`).
    slot_pool_low: int = 0
    slot_pool_high: int = 16
    # Pre-spawned restores per recently used template shape (node.warm); 0: off.
    # An entry waiting costs ~no CPU and a few MB of host memory (a QEMU over a private
    # mapping it has not touched) and one network slot. Two per shape lets a pair of creates
    # (a test and its fixture, a parent and its helper) both skip the spawn; refilling only
    # once the pool is empty (low 1) keeps the background work on a small host to one burst.
    warm_low: int = 1
    warm_high: int = 2
    # Entries of all shapes together (templates and named snapshots): each waits as a QEMU
    # and holds a network slot, and named snapshots can be many.
    warm_max: int = 8
    # Seconds a cold boot may take until envd answers; None: the accelerator's own (120 on
    # KVM and PVM, 360 under TCG: `vmm.accel.boot_deadline`).
    boot_timeout_s: float | None = None
    # Upstream resolvers (`ip` or `ip:port`) the slot gateways' DNS forwarder asks; guests'
    # resolv.conf names only their gateway.
    dns: tuple[str, ...] = ()
    # Create sandboxes by restoring their template's snapshot instead of booting a kernel.
    snapshots: bool = True
    # Paused sandboxes older than this are deleted (0: keep them forever).
    paused_retention_s: float = 7 * 24 * 3600.0
    # After its timeout a sandbox whose create did not say (`gracePeriod`) is paused this
    # long, then deleted, instead of killed at once (0: killed, as E2B does).
    timeout_grace_s: int = 0
    # Balloon of a sandbox without envd traffic for this long is inflated to the floor (0: off).
    idle_reclaim_s: float = 60.0
    balloon_floor_mb: int = 128
    # Host memory use in percent above which the idlest sandboxes are inflated (0: off).
    memory_pressure_pct: float = 80.0
    # Whether proxy traffic resumes a paused sandbox whose create request did not say
    # (`autoResume`); off by default, as E2B: only `autoResume: {"enabled": true}` resumes.
    auto_resume: bool = False
    # Admission (node.admission): running + starting sandboxes (0: no count limit,
    # memory, disk and slots still apply), starts at once, starts waiting (FIFO) beyond that,
    # host memory kept free after what running sandboxes may still grow into, and the free
    # space the data dir must keep.
    max_sandboxes: int = 0
    max_starts: int = field(default_factory=default_max_starts)
    start_queue: int = 128
    # How long a start that does not fit yet (count, slots, memory) waits for a sandbox to
    # end before its 503: a burst of creates queues instead of failing. Below the SDKs'
    # 60 s request timeout, with room for the create itself.
    capacity_wait_s: float = 30.0
    min_free_memory_mb: int = 256
    min_free_disk_mb: int = 1024
    # Every QEMU in its own uid, mount namespace and root, under seccomp (`vmm.confine`). On,
    # a missing piece fails the VM's start; only AGENTENV_CONFINE=off runs QEMU as root.
    confine: bool = True
    # Host disk IO each sandbox's writable disk may use (QEMU block throttling, reads and
    # writes together): MiB/s and requests/s, 0 = no limit. One guest writing flat out must
    # not take the host disk from its neighbours or the server's own database and logs.
    disk_bps_mb: int = 100
    disk_iops: int = 2000
    # Snapshots and templates in an S3 bucket (None: this node's disk only), and how much
    # local disk the blob cache of what was fetched from it may use before it evicts.
    object_store: ObjectStoreConfig | None = None
    blob_cache_mb: int = 20480
    # Members (`host:port`) of the etcd that holds the cluster's shared state (agentenv.cluster);
    # empty: one node, no etcd. All cluster keys live under `etcd_prefix`.
    etcd_endpoints: tuple[str, ...] = ()
    etcd_prefix: str = "/agentenv/"
    # How long a node's membership lease outlives its last heartbeat: the time a dead node
    # still looks alive, against the time a paused agent (GC, SIGSTOP) has before it is dead.
    node_ttl_s: int = 10
    # How often a control-plane replica compares each live node's sandboxes with the bindings
    # to it (`cluster.runtime`): the longest a sandbox that died while its agent was down
    # stays `running` once the agent is back with no lost reason of its own to tell.
    node_reconcile_s: int = 30
    # How often a node agent collects the bucket's garbage (blobs no manifest names and
    # nobody touched for an hour: `snapshot.remote.RemoteSnapshots.gc_blobs`); 0 = never.
    bucket_gc_s: int = 3600
    # Control-plane replicas on a shared store (`cluster.replicas`, `control.ownership`): how
    # long a replica's lease outlives its last heartbeat, how often each replica sweeps for
    # rows a gone replica left in a transitional state, and how long such a row must have
    # been seen orphaned before it is settled.
    replica_ttl_s: int = 10
    sweep_period_s: int = 2
    sweep_grace_s: int = 5
    # The shared secret every node RPC carries (`Authorization: Bearer`); None: a node agent
    # refuses to serve and a control plane cannot call one.
    node_token: str | None = field(default=None, repr=False)
    node_rpc: NodeRpcConfig = field(default_factory=NodeRpcConfig)
    # A node agent (`aenv node`): its id in the cluster (default: the host name), where it
    # serves the node RPC, and the URL the control plane calls it at (default: from the bind).
    node_id: str = ""
    node_bind: str = "127.0.0.1:7100"
    node_url: str = ""
    # The agent's data gateway (`agentenv.gateway`): where it listens (HOST:PORT; port 0 =
    # any free one; "off" = none, replicas then reach guests at their slot addresses, which
    # only works when they share the node's host), and the HOST:PORT replicas dial (default:
    # the bound address). TLS and token are the node RPC's.
    node_gateway_bind: str = "127.0.0.1:0"
    node_gateway_addr: str = ""

    @classmethod
    def from_env(cls) -> Settings:
        net = NetworkPlan()
        if raw := os.environ.get("AGENTENV_GUEST_CIDR"):
            net = replace(net, guest_cidr=parse_net("AGENTENV_GUEST_CIDR", raw, 30))
        if raw := os.environ.get("AGENTENV_SLOT_CIDR"):
            net = replace(net, slot_cidr=parse_net("AGENTENV_SLOT_CIDR", raw, 30))
        net = replace(
            net,
            rate_mbit=env_bounded("AGENTENV_NET_RATE_MBIT", net.rate_mbit, MAX_NET_RATE_MBIT),
            max_connections=env_bounded(
                "AGENTENV_SLOT_MAX_CONNECTIONS", net.max_connections, MAX_SLOT_CONNECTIONS
            ),
        )
        accel = os.environ.get("AGENTENV_ACCEL") or None
        if accel is not None and accel not in ("kvm", "pvm", "tcg"):
            raise ConfigError(f"AGENTENV_ACCEL={accel!r}: expected kvm, pvm or tcg")
        tb_size = env_int("AGENTENV_TCG_TB_SIZE_MB", cls.tcg_tb_size_mb)
        if not 32 <= tb_size <= 1024:
            raise ConfigError(f"AGENTENV_TCG_TB_SIZE_MB={tb_size}: expected 32..1024")
        pressure = env_int("AGENTENV_MEMORY_PRESSURE_PCT", 80)
        if not 0 <= pressure <= 100:
            raise ConfigError(f"AGENTENV_MEMORY_PRESSURE_PCT={pressure}: expected 0..100")
        floor = env_int("AGENTENV_BALLOON_FLOOR_MB", 128)
        if floor < 64:
            raise ConfigError(f"AGENTENV_BALLOON_FLOOR_MB={floor}: a guest needs at least 64")
        idle = env_int("AGENTENV_IDLE_RECLAIM_S", 60)
        if idle < 0:
            raise ConfigError(f"AGENTENV_IDLE_RECLAIM_S={idle}: expected 0 (off) or more")
        warm_low = env_int("AGENTENV_WARM_LOW", cls.warm_low)
        warm_high = env_int("AGENTENV_WARM_HIGH", cls.warm_high)
        if not 0 <= warm_low <= warm_high:
            raise ConfigError(
                f"AGENTENV_WARM_LOW={warm_low}, AGENTENV_WARM_HIGH={warm_high}: "
                "expected 0 <= low <= high"
            )
        warm_max = env_int("AGENTENV_WARM_MAX", cls.warm_max)
        if warm_max < 0:
            raise ConfigError(f"AGENTENV_WARM_MAX={warm_max}: expected 0 or more")
        limits = {
            name: env_int(name, default)
            for name, default in (
                ("AGENTENV_MAX_SANDBOXES", cls.max_sandboxes),
                ("AGENTENV_MAX_STARTS", default_max_starts()),
                ("AGENTENV_START_QUEUE", cls.start_queue),
                ("AGENTENV_CAPACITY_WAIT_S", int(cls.capacity_wait_s)),
                ("AGENTENV_TIMEOUT_GRACE_S", cls.timeout_grace_s),
                ("AGENTENV_MIN_FREE_MEMORY_MB", cls.min_free_memory_mb),
                ("AGENTENV_MIN_FREE_DISK_MB", cls.min_free_disk_mb),
                ("AGENTENV_DISK_BPS_MB", cls.disk_bps_mb),
                ("AGENTENV_DISK_IOPS", cls.disk_iops),
                ("AGENTENV_BLOB_CACHE_MB", cls.blob_cache_mb),
            )
        }
        for name, value in limits.items():
            least = 1 if name == "AGENTENV_MAX_STARTS" else 0
            if value < least:
                raise ConfigError(f"{name}={value}: expected {least} or more")
        # QEMU refuses throttle values above 10^15 (bytes or requests per second).
        for name in ("AGENTENV_DISK_BPS_MB", "AGENTENV_DISK_IOPS"):
            if limits[name] > MAX_DISK_LIMIT[name]:
                raise ConfigError(
                    f"{name}={limits[name]}: at most {MAX_DISK_LIMIT[name]} (0 = no limit)"
                )
        etcd_prefix = os.environ.get("AGENTENV_ETCD_PREFIX") or cls.etcd_prefix
        if not (etcd_prefix.startswith("/") and etcd_prefix.endswith("/")):
            raise ConfigError(f"AGENTENV_ETCD_PREFIX={etcd_prefix!r}: expected /name/")
        node_ttl = env_int("AGENTENV_NODE_TTL_S", cls.node_ttl_s)
        # etcd raises shorter leases to 1.5 election timeouts; 2 s is the shortest we promise.
        if node_ttl < 2:
            raise ConfigError(f"AGENTENV_NODE_TTL_S={node_ttl}: expected 2 or more")
        reconcile = env_int("AGENTENV_NODE_RECONCILE_S", cls.node_reconcile_s)
        replica_ttl = env_int("AGENTENV_REPLICA_TTL_S", cls.replica_ttl_s)
        if replica_ttl < 2:
            raise ConfigError(f"AGENTENV_REPLICA_TTL_S={replica_ttl}: expected 2 or more")
        sweep_period = env_int("AGENTENV_SWEEP_PERIOD_S", cls.sweep_period_s)
        sweep_grace = env_int("AGENTENV_SWEEP_GRACE_S", cls.sweep_grace_s)
        if sweep_period < 1 or sweep_grace < 0:
            raise ConfigError(
                f"AGENTENV_SWEEP_PERIOD_S={sweep_period}, AGENTENV_SWEEP_GRACE_S={sweep_grace}: "
                "expected a period of 1 or more and a grace of 0 or more"
            )
        if reconcile < 1:
            raise ConfigError(f"AGENTENV_NODE_RECONCILE_S={reconcile}: expected 1 or more")
        bucket_gc = env_int("AGENTENV_BUCKET_GC_S", cls.bucket_gc_s)
        if bucket_gc < 0:
            raise ConfigError(f"AGENTENV_BUCKET_GC_S={bucket_gc}: expected 0 (off) or more")
        node_rpc = NodeRpcConfig.from_env()
        node_url = os.environ.get("AGENTENV_NODE_URL", "")
        if node_rpc.serves_tls and node_url and not node_url.startswith("https://"):
            # Replicas would speak plain HTTP to a port that only answers TLS.
            raise ConfigError(
                f"AGENTENV_NODE_URL={node_url!r}: the agent serves TLS "
                "(AGENTENV_NODE_TLS_CERT), so its URL must be https://"
            )
        return cls(
            home=env_path("AGENTENV_HOME", Path("/var/lib/agentenv")),
            cache=default_cache(),
            etcd_endpoints=etcd_endpoints_from_env(),
            etcd_prefix=etcd_prefix,
            node_ttl_s=node_ttl,
            node_reconcile_s=reconcile,
            bucket_gc_s=bucket_gc,
            replica_ttl_s=replica_ttl,
            sweep_period_s=sweep_period,
            sweep_grace_s=sweep_grace,
            node_token=os.environ.get("AGENTENV_NODE_TOKEN") or None,
            node_rpc=node_rpc,
            node_id=parse_node_id(os.environ.get("AGENTENV_NODE_ID") or socket.gethostname()),
            node_bind=os.environ.get("AGENTENV_NODE_BIND") or cls.node_bind,
            node_url=node_url,
            node_gateway_bind=gateway_bind_from_env(
                os.environ.get("AGENTENV_NODE_BIND") or cls.node_bind
            ),
            node_gateway_addr=os.environ.get("AGENTENV_NODE_GATEWAY_ADDR", ""),
            kernel=env_opt_path("AGENTENV_KERNEL"),
            initramfs=env_opt_path("AGENTENV_INITRAMFS"),
            accel=accel,
            tcg_tb_size_mb=tb_size,
            pvm_kernel=env_opt_path("AGENTENV_PVM_KERNEL"),
            qemu_binary=os.environ.get("AGENTENV_QEMU", "qemu-system-x86_64"),
            network=net,
            slot_pool_low=env_int("AGENTENV_SLOT_POOL_LOW", cls.slot_pool_low),
            slot_pool_high=env_int("AGENTENV_SLOT_POOL_HIGH", cls.slot_pool_high),
            warm_low=warm_low,
            warm_high=warm_high,
            warm_max=warm_max,
            boot_timeout_s=boot_timeout_from_env(),
            snapshots=env_int("AGENTENV_SNAPSHOTS", 1) != 0,
            paused_retention_s=float(env_int("AGENTENV_PAUSED_RETENTION", 7 * 24 * 3600)),
            timeout_grace_s=limits["AGENTENV_TIMEOUT_GRACE_S"],
            dns=dns_servers_from_env(),
            idle_reclaim_s=float(idle),
            balloon_floor_mb=floor,
            memory_pressure_pct=float(pressure),
            auto_resume=env_bool("AGENTENV_AUTO_RESUME", False),
            max_sandboxes=limits["AGENTENV_MAX_SANDBOXES"],
            max_starts=limits["AGENTENV_MAX_STARTS"],
            start_queue=limits["AGENTENV_START_QUEUE"],
            capacity_wait_s=float(limits["AGENTENV_CAPACITY_WAIT_S"]),
            min_free_memory_mb=limits["AGENTENV_MIN_FREE_MEMORY_MB"],
            min_free_disk_mb=limits["AGENTENV_MIN_FREE_DISK_MB"],
            confine=env_switch("AGENTENV_CONFINE", True),
            disk_bps_mb=limits["AGENTENV_DISK_BPS_MB"],
            disk_iops=limits["AGENTENV_DISK_IOPS"],
            object_store=ObjectStoreConfig.from_env(),
            blob_cache_mb=limits["AGENTENV_BLOB_CACHE_MB"],
        )

    # Layout of the data dir. Components create what they use.
    @property
    def layers_dir(self) -> Path:
        return self.home / "layers"

    @property
    def sandboxes_dir(self) -> Path:
        return self.home / "sandboxes"

    @property
    def warm_dir(self) -> Path:
        """Workdirs of warm pool entries (node.warm), outside `sandboxes_dir` until
        a create takes one and moves it there; same filesystem, so that is a rename."""
        return self.home / "warm"

    @property
    def templates_file(self) -> Path:
        return self.home / "templates.json"

    @property
    def run_dir(self) -> Path:
        return self.home / "run"

    @property
    def vms_dir(self) -> Path:
        """One record per QEMU this data dir runs (`vmm.registry`): how a restarted server
        finds what its predecessor left running."""
        return self.run_dir / "vms"

    @property
    def blobs_dir(self) -> Path:
        """Blobs fetched from object storage (`objstore.cache`) and the records of uploads
        under way (`objstore/uploads`), so a killed upload resumes."""
        return self.home / "blobs"

    @property
    def slots_dir(self) -> Path:
        """One marker per network slot this data dir holds (`network.slot`)."""
        return self.run_dir / "slots"
