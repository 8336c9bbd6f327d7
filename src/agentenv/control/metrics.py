"""Prometheus instruments for the control plane and the proxy.

Each server instance owns its own registry so several servers (tests, benches) can live in one
process without colliding on metric names.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from agentenv.contract.nodes import NodeStatus
from agentenv.contract.runtime import HostMemory
from agentenv.control.store import SandboxState

MIB = 1 << 20
_LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 3, 5, 8, 13, 20, 30, 60, 120)


class _StateCollector(Collector):
    """Users' sandboxes by state, and apart from them the template build sandboxes (which
    hold VMs, and capacity, like any other)."""

    def __init__(
        self, counts: Callable[[], dict[str, int]], builds: Callable[[], int] | None
    ) -> None:
        self._counts = counts
        self._builds = builds

    def collect(self) -> list[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            "agentenv_sandboxes", "Sandboxes by lifecycle state", labels=["state"]
        )
        counts = self._counts()
        for state in SandboxState:
            if state is not SandboxState.GONE:
                family.add_metric([state.value], counts.get(state.value, 0))
        out = [family]
        if self._builds is not None:
            out.append(
                GaugeMetricFamily(
                    "agentenv_build_sandboxes",
                    "Template build sandboxes that hold a VM (not in agentenv_sandboxes)",
                    value=self._builds(),
                )
            )
        return out


class _HostMemoryCollector(Collector):
    """Per running sandbox, read at scrape time: a sandbox's series ends with it."""

    def __init__(self, samples: Callable[[], dict[str, HostMemory]]) -> None:
        self._samples = samples

    def collect(self) -> list[GaugeMetricFamily]:
        pss = GaugeMetricFamily(
            "agentenv_sandbox_host_pss_bytes",
            "Host memory of a running sandbox's VMM process (proportional set size)",
            labels=["sandbox_id"],
        )
        rss = GaugeMetricFamily(
            "agentenv_sandbox_host_rss_bytes",
            "Resident memory of a running sandbox's VMM process (shared pages counted in full)",
            labels=["sandbox_id"],
        )
        for sandbox_id, mem in sorted(self._samples().items()):
            pss.add_metric([sandbox_id], mem.pss)
            rss.add_metric([sandbox_id], mem.rss)
        return [pss, rss]


class _NodeCollector(Collector):
    """Per node, from the last `GET /nodes` listing (`NodeDirectory.nodes()`): its capacity,
    what it has free, its sandboxes and whether it takes new ones. A node that left has no
    series any more."""

    def __init__(self, statuses: Callable[[], list[NodeStatus]]) -> None:
        self._statuses = statuses

    def collect(self) -> list[GaugeMetricFamily]:
        def per_node(name: str, doc: str) -> GaugeMetricFamily:
            return GaugeMetricFamily(f"agentenv_node_{name}", doc, labels=["node_id"])

        state = GaugeMetricFamily(
            "agentenv_node_state",
            "1 for the node's state (ready: takes new sandboxes; cordoned: does not), 0 else",
            labels=["node_id", "state"],
        )
        sandboxes = GaugeMetricFamily(
            "agentenv_node_sandboxes",
            "Sandboxes a node runs (as it last published) and paused ones bound to it",
            labels=["node_id", "state"],
        )
        cpus = per_node("cpus", "CPUs of the node's host")
        memory = per_node("memory_bytes", "Memory of the node's host")
        free_memory = per_node("free_memory_bytes", "Memory the node can still give sandboxes")
        slots = per_node("slots", "Network slots of the node (its most sandboxes at once)")
        free_slots = per_node("free_slots", "Network slots the node has free")
        updated = per_node(
            "load_timestamp_seconds", "When the node last published its load (unix time)"
        )
        for st in sorted(self._statuses(), key=lambda st: st.node_id):
            node = [st.node_id]
            for name in ("ready", "cordoned"):
                state.add_metric([st.node_id, name], 1 if st.state == name else 0)
            sandboxes.add_metric([st.node_id, "running"], st.running)
            sandboxes.add_metric([st.node_id, "paused"], st.paused)
            cpus.add_metric(node, st.cpus)
            memory.add_metric(node, st.memory_mb * MIB)
            free_memory.add_metric(node, st.free_memory_mb * MIB)
            slots.add_metric(node, st.slots)
            free_slots.add_metric(node, st.free_slots)
            updated.add_metric(node, st.updated_at)
        return [state, sandboxes, cpus, memory, free_memory, slots, free_slots, updated]


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.create_seconds = Histogram(
            "agentenv_sandbox_create_seconds",
            "Time from create request to a running sandbox",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.resume_seconds = Histogram(
            "agentenv_sandbox_resume_seconds",
            "Time to resume a paused sandbox",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.sandboxes_lost = Counter(
            "agentenv_sandboxes_lost",
            "Running sandboxes whose VM ended on its own (crash, killed from outside)",
            registry=self.registry,
        )
        self.create_failures = Counter(
            "agentenv_sandbox_create_failures",
            "Sandbox creations that failed and were torn down",
            registry=self.registry,
        )
        # A refusal made nothing and is the caller's signal to retry: not a failure.
        self.create_refusals = Counter(
            "agentenv_sandbox_create_refusals",
            "Sandbox creations refused before anything was made (no capacity, disk full)",
            ["status"],
            registry=self.registry,
        )
        self.proxy_bytes = Counter(
            "agentenv_proxy_bytes",
            "Bytes relayed by the data-plane proxy",
            ["direction"],
            registry=self.registry,
        )
        self.proxy_requests = Counter(
            "agentenv_proxy_requests",
            "Data-plane requests by outcome",
            ["outcome"],
            registry=self.registry,
        )
        self.proxy_tunnels = Counter(
            "agentenv_proxy_tunnels",
            "Connections the proxy opened through a node's data gateway",
            ["gateway"],
            registry=self.registry,
        )

    def watch_states(
        self, counts: Callable[[], dict[str, int]], builds: Callable[[], int] | None = None
    ) -> None:
        self.registry.register(_StateCollector(counts, builds))

    def watch_host_memory(self, samples: Callable[[], dict[str, HostMemory]]) -> None:
        self.registry.register(_HostMemoryCollector(samples))

    def watch_nodes(self, statuses: Callable[[], list[NodeStatus]]) -> None:
        self.registry.register(_NodeCollector(statuses))
