"""Request bodies of the control plane, with the limits bad input is checked against.

Field names are the wire names the E2B SDKs send (camelCase, plus the snake_case
``allow_internet_access``). Unknown fields are rejected so a typo never silently does nothing.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, field_validator

from agentenv.control.sandbox_base import MAX_CAPACITY_WAIT_S, MAX_TIMEOUT_S

MAX_METADATA_ENTRIES = 64
MAX_METADATA_KEY = 128
MAX_METADATA_VALUE = 1024
MAX_ENV_ENTRIES = 256
MAX_ENV_KEY = 256
MAX_ENV_VALUE = 32 * 1024

Timeout = Annotated[StrictInt, Field(ge=1, le=MAX_TIMEOUT_S)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


def _check_map(
    value: dict[str, str], what: str, entries: int, key_len: int, value_len: int
) -> dict[str, str]:
    if len(value) > entries:
        raise ValueError(f"{what} has {len(value)} entries (max {entries})")
    for k, v in value.items():
        if not k or len(k) > key_len:
            raise ValueError(f"{what} key must be 1-{key_len} characters")
        if len(v) > value_len:
            raise ValueError(f"{what} value for {k[:40]!r} exceeds {value_len} characters")
    return value


class AutoResume(_Strict):
    enabled: StrictBool = False


class VolumeMount(_Strict):
    name: str
    path: str


class NetworkConfig(_Strict):
    allowPublicTraffic: StrictBool | None = None
    allowOut: list[str] | None = None
    denyOut: list[str] | None = None
    dnsServers: list[str] | None = None
    maskRequestHost: str | None = None
    httpsPorts: list[int] | None = None
    egressProxy: dict[str, Any] | None = None
    rules: dict[str, Any] | None = None


class NewSandbox(_Strict):
    templateID: str = Field(min_length=1, max_length=256)
    timeout: Timeout | None = None
    autoPause: StrictBool = False
    autoPauseMemory: StrictBool | None = None
    autoResume: AutoResume | None = None
    secure: StrictBool = True
    allow_internet_access: StrictBool = True
    network: NetworkConfig | None = None
    metadata: dict[str, str] = Field(default_factory=dict)
    envVars: dict[str, str] = Field(default_factory=dict)
    mcp: dict[str, Any] | None = None
    iam: dict[str, Any] | None = None
    volumeMounts: list[VolumeMount] | None = None
    # agentenv extensions: resources per sandbox (the template's defaults otherwise).
    cpuCount: Annotated[StrictInt, Field(ge=1, le=64)] | None = None
    memoryMB: Annotated[StrictInt, Field(ge=1, le=1 << 20)] | None = None
    diskSizeMB: Annotated[StrictInt, Field(ge=1, le=1 << 22)] | None = None
    # agentenv extensions for rollouts: after the timeout, paused (memory kept) this many
    # seconds before it is deleted, so a late scorer can still connect (0: off; unset: the
    # server's AGENTENV_TIMEOUT_GRACE_S); and killed once no client touched it (an API call
    # on it, proxied traffic) for `keepalive` seconds (0: off).
    gracePeriod: Annotated[StrictInt, Field(ge=0, le=MAX_TIMEOUT_S)] | None = None
    keepalive: Annotated[StrictInt, Field(ge=0, le=MAX_TIMEOUT_S)] = 0
    # agentenv extension for bursts: how long this create may wait in the node's queue for
    # capacity before a 503 (0: refuse at once; unset: the server's AGENTENV_CAPACITY_WAIT_S).
    # The `X-Capacity-Wait` header says the same for clients that cannot add body fields.
    capacityWait: Annotated[StrictInt, Field(ge=0, le=MAX_CAPACITY_WAIT_S)] | None = None

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, v: dict[str, str]) -> dict[str, str]:
        return _check_map(v, "metadata", MAX_METADATA_ENTRIES, MAX_METADATA_KEY, MAX_METADATA_VALUE)

    @field_validator("envVars")
    @classmethod
    def _env(cls, v: dict[str, str]) -> dict[str, str]:
        return _check_map(v, "envVars", MAX_ENV_ENTRIES, MAX_ENV_KEY, MAX_ENV_VALUE)


class NetworkUpdate(_Strict):
    """`PUT /sandboxes/{id}/network`: the sandbox's whole egress config (E2B's
    SandboxNetworkUpdateConfig; omitted fields are cleared)."""

    allowInternetAccess: StrictBool | None = None
    allowOut: list[str] | None = None
    denyOut: list[str] | None = None
    dnsServers: list[str] | None = None
    egressProxy: dict[str, Any] | None = None
    rules: dict[str, Any] | None = None


class ConnectBody(_Strict):
    timeout: Timeout | None = None
    # `false`: a paused sandbox comes back by a cold boot from its disk, its saved memory
    # dropped (a running one ignores it).
    memory: StrictBool | None = None


class TimeoutBody(_Strict):
    timeout: Annotated[StrictInt, Field(ge=0, le=MAX_TIMEOUT_S)]


class RefreshBody(_Strict):
    duration: Annotated[StrictInt, Field(ge=0, le=3600)] | None = None


class PauseBody(_Strict):
    # `false`: keep the filesystem only (the resume boots from it); needs a responding envd.
    memory: StrictBool | None = None
    # True: refuse (503) while the guest's envd does not answer; the sandbox keeps running.
    requireHealthyGuest: StrictBool | None = None


class SnapshotBody(_Strict):
    name: Annotated[str, Field(min_length=1, max_length=63)] | None = None
    # `false`: the filesystem only; sandboxes created from it boot from that disk.
    memory: StrictBool | None = None


class ResetBody(_Strict):
    # A persistent snapshot (id or name) of the same machine shape; unset: the template the
    # sandbox was created from.
    snapshot: Annotated[str, Field(min_length=1, max_length=256)] | None = None


class ForkBody(_Strict):
    count: Annotated[StrictInt, Field(ge=1, le=100)] = 1
    timeout: Timeout | None = None


class ResumeBody(_Strict):
    timeout: Timeout | None = None
    # Replaces the sandbox's auto-pause setting once it runs again (E2B: deprecated).
    autoPause: StrictBool | None = None
    # `false`: cold-boot from its disk, memory dropped, as on connect.
    memory: StrictBool | None = None
