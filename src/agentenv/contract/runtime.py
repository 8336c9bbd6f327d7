"""What the control plane needs from whatever runs sandboxes (one node in-process, or many).

The state machine talks only to this protocol. Everything a sandbox needs travels in the call
(`SandboxSpec`): the node gives the guest its identity, env vars and access token in one envd
`/init`, so the control plane never talks to a guest's envd itself, and the same calls work
in-process (`node.runtime.NodeRuntime`) or over RPC to a node on another host. A sandbox has
one id, chosen by the control plane: the node runs it under that id.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

from agentenv.contract.egress import OPEN, Egress


@dataclass(frozen=True)
class HostMemory:
    """Memory a process holds on the host, in bytes (what a sandbox's VMM costs its node)."""

    rss: int
    pss: int
    pss_anon: int
    pss_file: int
    pss_shmem: int


# A snapshot's id (32 hex digits, `snapshot.repository.SnapshotRepository.commit`): what a
# create names as its template when it starts from a snapshot rather than a template.
SNAPSHOT_ID = re.compile(r"[0-9a-f]{32}")


@dataclass(frozen=True)
class SandboxSpec:
    """Everything a node needs to run one sandbox, whole in every create and resume (a resume
    may land on a node that has never seen the sandbox)."""

    sandbox_id: str
    template: str
    cpu: int
    memory_mb: int
    # None: the template's own size.
    disk_size_mb: int | None = None
    egress: Egress = OPEN
    # The caller's env vars for every command (on top of the template's defaults).
    env_vars: Mapping[str, str] = field(default_factory=dict)
    # What envd requires of every request (`X-Access-Token`); None: a sandbox without one.
    envd_token: str | None = None
    # The caller's metadata: the node keeps it with the sandbox (listing, logs), unread.
    metadata: Mapping[str, str] = field(default_factory=dict)
    # How long a create may wait in the node's queue for capacity before it is refused
    # (503); None: the node's own default (AGENTENV_CAPACITY_WAIT_S).
    capacity_wait_s: float | None = None


@dataclass(frozen=True)
class Placement:
    """Where a running sandbox can be reached."""

    sandbox_id: str
    # Host (IP) that forwards every guest port: the slot address for microVMs.
    address: str
    envd_url: str
    # The guest started fresh from its disk (a filesystem-only resume): its envd knows
    # nothing of the sandbox yet and needs the full `/init` (token, env vars).
    booted: bool = False
    # The cluster node it runs on (None: the in-process node); the proxy reaches `address`
    # through that node's data gateway (`Runtime.gateway`).
    node_id: str | None = None
    # The saved state it started from when that is not its template's: a fork's child
    # holds its fork's capture (a snapshot id), and a reset with no target goes back there.
    origin: str | None = None


class RuntimeFailure(Exception):
    """Base class of runtime failures surfaced to the API."""


class Unsupported(RuntimeFailure):
    """The runtime cannot perform this operation (e.g. pause before snapshots exist)."""


class TemplateUnavailable(RuntimeFailure):
    """The runtime has no template by that name."""


class TagUnavailable(TemplateUnavailable):
    """The template exists but the tag asked for names no ready build (E2B's message)."""


class Lost(RuntimeFailure):
    """The sandbox is gone for good (its VM died, or ran and failed after a resume)."""


class GuestFailed(RuntimeFailure):
    """A running sandbox's envd refused a call or could not be asked (`guest_run`,
    `guest_write`, `guest_defaults`): the command did not run, or its stream broke."""


@dataclass(frozen=True)
class GuestCommand:
    """One shell command run in a running sandbox through its envd (`Runtime.guest_run`):
    `/bin/sh -c cmd` as `user`, with `envs` on top of the sandbox's, in `cwd`."""

    cmd: str
    user: str = "root"
    envs: Mapping[str, str] = field(default_factory=dict)
    cwd: str | None = None
    # The whole command's deadline, enforced by envd (and by the node RPC's call).
    timeout_s: float = 3600.0


# The most `Runtime.guest_write` takes in one call (the node RPC's message bound is 4 MiB):
# a larger file goes as several calls, the later ones with `append`.
GUEST_WRITE_MAX_BYTES = 2 * 1024 * 1024


@dataclass(frozen=True)
class Found:
    """What the runtime holds of a sandbox (after a restart: what it re-adopted)."""

    state: Literal["running", "paused"]
    # Where it runs; None while paused.
    placement: Placement | None
    # Paused: whether the pause kept its memory (False: filesystem only, resumed by a boot).
    memory: bool = True


@dataclass(frozen=True)
class SnapshotInfo:
    snapshot_id: str
    names: list[str]
    # The sandbox (sandbox id) or template it was captured from.
    source: str
    created_at: float
    cpu: int
    memory_mb: int


@dataclass(frozen=True)
class ImportEvent:
    """One report of an image import: a log line, or (`layer`) one layer's progress as the
    OCI pull reports it (`oci.progress.LayerProgress`'s fields)."""

    message: str = ""
    layer: dict[str, Any] | None = None


class Runtime(Protocol):
    async def start(self) -> None: ...

    async def close(self) -> None: ...

    async def create(self, spec: SandboxSpec) -> Placement:
        """A running sandbox under `spec.sandbox_id` whose envd has had its one `/init`
        (hostname, clock, entropy, the template's defaults, `spec.env_vars`, `spec.envd_token`)
        and whose guest may open connections only as `spec.egress` says, from the start (kept
        across pause/resume and given to fork children)."""
        ...

    async def create_many(self, specs: Sequence[SandboxSpec]) -> list[Placement | BaseException]:
        """`create` of each spec (a snapshot's fork of N), concurrently; each result is its
        placement or what its `create` would have raised (a failed one left nothing behind;
        the caller decides about the others). A node starts a batch of one named snapshot
        as one start: admitted for all at once and restored together."""
        ...

    async def reset(self, spec: SandboxSpec) -> Placement:
        """Put the running sandbox `spec.sandbox_id` back to `spec.template`'s saved state in
        place: same id and network slot, a new QEMU and upper, and the full `/init` of a
        create from `spec`. ``Lost`` when it failed once the old guest was stopped (the
        sandbox is gone); any other error is raised before anything changed (the sandbox
        runs as it was), ``Unsupported`` when this runtime cannot reset in place (the caller
        replaces the sandbox by a delete and a create). A cancel may leave either."""
        ...

    async def update_egress(self, sandbox_id: str, egress: Egress) -> None:
        """Replace a running or paused sandbox's egress policy (at once while it runs)."""
        ...

    async def delete(self, sandbox_id: str) -> None:
        """The sandbox goes for good: its VM, its files, and its copy in object storage."""
        ...

    async def forget(self, sandbox_id: str) -> None:
        """Drop this runtime's own copy of a sandbox that lives on another node now (its VM
        if any, its files here), touching nothing shared: the object store's copy stays."""
        ...

    async def pause(
        self,
        sandbox_id: str,
        *,
        memory: bool = True,
        envd_token: str | None = None,
        strict: bool = True,
    ) -> None:
        """Freeze the sandbox into a snapshot and release its VM; may raise ``Unsupported``.
        ``memory=False``: keep only its disk, flushed through envd (``envd_token``); with
        ``strict`` a guest whose envd cannot flush it is not paused (``Unavailable``)."""
        ...

    async def resume(self, spec: SandboxSpec, *, memory: bool = True) -> Placement:
        """Bring a paused sandbox back and re-initialise its envd (clock, entropy, with
        `spec.envd_token`); may raise ``Unsupported``. A filesystem-only pause, or
        ``memory=False``, comes back by a cold boot over its disk (``booted``), whose new envd
        gets the full `/init` of a create from `spec`."""
        ...

    async def init_guest(self, spec: SandboxSpec) -> None:
        """Give a running sandbox's envd the full `/init` of a create again (env vars, token,
        clock, entropy): after a crash that may have cut a start short before its `/init`."""
        ...

    async def guest_metrics(self, sandbox_id: str, envd_token: str | None) -> dict[str, Any] | None:
        """The running sandbox's envd `/metrics` sample, None when the guest cannot say."""
        ...

    async def guest_health(self, sandbox_id: str) -> str | None:
        """Why the running sandbox's envd does not answer `/health` now (bounded by a short
        deadline), or None when it does."""
        ...

    async def guest_run(
        self,
        sandbox_id: str,
        envd_token: str | None,
        command: GuestCommand,
        on_line: Callable[[str, str], None],
    ) -> int:
        """Runs `command` in the running sandbox; each output line goes to
        `on_line(line, "stdout"|"stderr")` as it comes. Returns the exit code; ``GuestFailed``
        when envd could not run it or its stream broke."""
        ...

    async def guest_write(
        self, sandbox_id: str, envd_token: str | None, path: str, data: bytes, *, append: bool
    ) -> None:
        """Writes `data` (at most `GUEST_WRITE_MAX_BYTES`) to `path` in the running sandbox,
        as root; `append` adds it to the end of what is there. ``GuestFailed`` on a refusal."""
        ...

    async def guest_defaults(
        self, sandbox_id: str, envd_token: str | None, user: str, workdir: str
    ) -> None:
        """Sets the user and working directory the sandbox's envd runs commands with when a
        call names none (kept in its memory, so in a snapshot of it)."""
        ...

    async def is_alive(self, sandbox_id: str) -> bool:
        """Whether the runtime still holds this sandbox, running or paused."""
        ...

    async def find(self, sandbox_id: str) -> Found | None:
        """Running (where) or paused, None if the runtime does not hold it."""
        ...

    async def sandbox_ids(self) -> list[str]:
        """Every sandbox the runtime holds, running or paused."""
        ...

    async def lost_reason(self, sandbox_id: str) -> str | None:
        """Why a sandbox the runtime no longer holds was lost, if it knows."""
        ...

    def watch_lost(self, handler: Callable[[str, str], None]) -> None:
        """`handler(sandbox_id, why)` is called the moment a running sandbox's VM ends on
        its own; the handler deletes it (`delete`)."""
        ...

    async def snapshot(
        self, sandbox_id: str, name: str | None, envd_token: str | None, *, memory: bool = True
    ) -> SnapshotInfo:
        """Capture a running sandbox (which keeps running) as a snapshot others can start
        from by id or name; `envd_token` is the guest's current envd token. `memory=False`:
        its disk only; creates from it cold-boot."""
        ...

    async def fork(
        self, sandbox_id: str, children: list[SandboxSpec], envd_token: str | None
    ) -> list[Placement]:
        """One new running sandbox per `children` entry (its id, env vars and envd token;
        template and shape are the source's) from one capture of a running sandbox, or of
        a paused one (which stays paused as it was; ``Conflict`` if its pause kept no
        memory), whose envd token is `envd_token`; each child's envd has had its `/init`.
        All or none."""
        ...

    async def snapshots(self) -> list[SnapshotInfo]:
        """Persistent snapshots (not template snapshots or fork captures)."""
        ...

    async def delete_snapshot(self, snapshot_id: str) -> bool:
        """Deletes a persistent snapshot by id, wherever the runtime keeps it (its files,
        object storage). False: no such snapshot. Sandboxes created from it keep running."""
        ...

    async def import_image(
        self,
        ref: str,
        name: str,
        credentials: tuple[str, str] | None,
        on_event: Callable[[ImportEvent], None],
    ) -> TemplateInfo:
        """Pulls the container image `ref` and registers it as catalog template `name` where
        sandboxes run (a cluster: on one node, which creates from it from then on).
        `on_event` gets the pull's log lines and layer reports, maybe from another thread."""
        ...

    async def remove_image(self, name: str) -> bool:
        """Removes catalog template `name` (``image-…``, what a `fromImage` build imported)
        where sandboxes run (a cluster: on every live node that has it). False: none had it.
        Sandboxes running from it keep the layers they use."""
        ...

    async def gateway(self, node_id: str) -> str | None:
        """Where the proxy reaches the guests of cluster node `node_id`: its data gateway
        (HOST:PORT, `agentenv.gateway`), or None to reach their slot addresses directly."""
        ...

    def note_activity(self, sandbox_id: str) -> None:
        """Traffic reached the sandbox (the proxy calls this): it is not idle. Never waits."""
        ...

    async def host_memory(self, sandbox_id: str) -> HostMemory | None:
        """What a running sandbox holds on the host (PSS of its VMM), None if not running."""
        ...


@dataclass(frozen=True)
class TemplateInfo:
    name: str
    size_mb: int
    created_at: float
    updated_at: float
    cpu: int
    memory_mb: int
    # What the runtime creates from when that is not the name asked for: a built template's
    # `name:tag` resolves to the snapshot id of the build the tag names.
    ref: str = ""
    # The templateID its sandboxes report ("" = the name they were created with); a built
    # template's is its name without the tag, as E2B reports the template, not the tag.
    template_id: str = ""
    # A catalog template's read-only layers (bottom → top) and the defaults its commands
    # run with (an image's config): what a build from it starts from and is keyed by.
    layers: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    user: str | None = None
    workdir: str | None = None
    # A snapshot created from by name: its id (what a build from it is keyed by).
    snapshot_id: str = ""

    def to_json(self) -> str:
        """One encoding wherever a template travels (the node RPC, the cluster's catalog)."""
        body: dict[str, Any] = dataclasses.asdict(self)
        body["layers"] = list(self.layers)
        body["env"] = dict(self.env)
        return json.dumps(body, sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, raw: str | bytes) -> TemplateInfo:
        """Raises ValueError, KeyError or TypeError for what is not `to_json`'s."""
        body = json.loads(raw)
        return cls(
            name=str(body["name"]),
            size_mb=int(body["size_mb"]),
            created_at=float(body["created_at"]),
            updated_at=float(body["updated_at"]),
            cpu=int(body["cpu"]),
            memory_mb=int(body["memory_mb"]),
            ref=str(body.get("ref", "")),
            template_id=str(body.get("template_id", "")),
            layers=tuple(str(d) for d in body.get("layers", [])),
            env=tuple(sorted((str(k), str(v)) for k, v in dict(body.get("env", {})).items())),
            user=body.get("user"),
            workdir=body.get("workdir"),
            snapshot_id=str(body.get("snapshot_id", "")),
        )


# Templates a node builds on the first create that names one (`node.ondemand`), by every
# name a create may use, mapped to the catalog name: the E2B code-interpreter SDKs create
# from `code-interpreter-v1` with no setup step of their own.
ON_DEMAND_TEMPLATES = {
    "code-interpreter-v1": "code-interpreter-v1",
    "code-interpreter": "code-interpreter-v1",
}


def on_demand_info(name: str) -> TemplateInfo | None:
    """What a template source answers for an on-demand template that is not built yet (None
    for any other name): sizes unknown (0), so the request's values or the defaults are
    recorded; the node answers the create 503 + Retry-After while it builds."""
    real = ON_DEMAND_TEMPLATES.get(name)
    if real is None:
        return None
    return TemplateInfo(name=real, size_mb=0, created_at=0.0, updated_at=0.0, cpu=0,
                        memory_mb=0, template_id=real)  # fmt: skip


@dataclass(frozen=True)
class SnapshotDetails:
    """A snapshot in the repository of the control plane's own host (`SnapshotFiles`)."""

    snapshot_id: str
    names: tuple[str, ...]
    cpu: int
    memory_mb: int
    envd_version: str
    # Its disk (the top layer's virtual size).
    size_mb: int


@runtime_checkable
class SnapshotFiles(Protocol):
    """The snapshots of a single-node server's own host, as its control plane reads and drops
    them by id or name (the node's catalog implements it; a cluster's replicas hold none and
    reach snapshots through `Runtime`)."""

    async def details(self, ref: str) -> SnapshotDetails | None:
        """The snapshot `ref` names (id or name), None if none."""
        ...

    def snapshot_id(self, name: str) -> str | None:
        """The id of the snapshot `name` names, None if none (blocking: a file read)."""
        ...

    async def remove_name(self, name: str) -> None:
        """`name` stops naming its snapshot (which stays); nothing if it names none."""
        ...


class TemplateSource(Protocol):
    async def get(self, name: str) -> TemplateInfo:
        """Raises ``TemplateUnavailable`` for an unknown name. Async: a cluster's built
        templates are records in etcd, and a snapshot's size takes a `qemu-img info`."""
        ...

    async def list(self) -> list[TemplateInfo]: ...

    async def delete(self, name: str) -> bool: ...
