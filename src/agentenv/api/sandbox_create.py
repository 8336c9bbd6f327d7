"""`POST /sandboxes` (v1) and `POST /v2/sandboxes`: the create request checked field by field
(what this server does not do is a 400 naming it), then handed to the manager, once per
`Idempotency-Key`."""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from typing import Annotated

from fastapi import FastAPI, Header
from fastapi.responses import JSONResponse

from agentenv.api import views
from agentenv.api.auth import ApiError, Auth
from agentenv.api.context import ControlContext
from agentenv.api.ingress import BadIngress, check_ingress
from agentenv.api.models import NewSandbox
from agentenv.api.template_builds import TemplateBuilds
from agentenv.contract.egress import BadTarget, Egress
from agentenv.contract.errors import TemplateNotFound
from agentenv.control.sandbox_base import DEFAULT_TIMEOUT_S, MAX_CAPACITY_WAIT_S, CreateSpec
from agentenv.control.store import BUILD_METADATA, ApiKey

IDEMPOTENCY_TTL_S = 24 * 3600


def mount_create(app: FastAPI, ctx: ControlContext, builds: TemplateBuilds) -> None:
    mgr = ctx.manager
    built = builds.built
    tenancy = builds.tenancy

    # -- create ----------------------------------------------------------------------------

    async def create(
        body: NewSandbox, key: ApiKey, idem_key: str | None, wait: str | None, *, v2: bool
    ) -> JSONResponse:
        if body.volumeMounts:
            raise ApiError(400, "volumeMounts are not supported by this server")
        if body.mcp is not None:
            raise ApiError(400, "mcp sandboxes are not supported by this server")
        if (
            body.autoPauseMemory is False
            and body.autoResume is not None
            and body.autoResume.enabled
        ):
            # As E2B: traffic never resumes a filesystem-only pause (it would reboot the guest).
            raise ApiError(
                400,
                "autoResume.enabled: true cannot be combined with autoPauseMemory: false; a "
                "sandbox paused without memory is resumed only by connect",
            )
        network = body.network.model_dump(exclude_none=True) if body.network else {}
        refuse_unenforced(body, network)
        if BUILD_METADATA in body.metadata:
            raise ApiError(400, f"metadata.{BUILD_METADATA}: reserved for template builds")
        if await built.internal(body.templateID) or not await tenancy.template_visible(
            body.templateID, key.team_id
        ):
            raise TemplateNotFound(body.templateID)
        spec = CreateSpec(
            template=body.templateID,
            timeout=body.timeout or DEFAULT_TIMEOUT_S,
            auto_pause=body.autoPause,
            auto_pause_memory=body.autoPauseMemory is not False,
            auto_resume=body.autoResume.enabled if body.autoResume is not None else None,
            # v2 is always secured; v1 asks with `secure`.
            secure=True if v2 else body.secure,
            allow_internet=body.allow_internet_access,
            metadata=body.metadata,
            env_vars=body.envVars,
            network=network,
            cpu=body.cpuCount,
            memory_mb=body.memoryMB,
            disk_mb=body.diskSizeMB,
            grace_s=body.gracePeriod,
            keepalive_s=body.keepalive,
            capacity_wait_s=_capacity_wait(body.capacityWait, wait),
        )
        if not idem_key:
            rec = await mgr.create(spec, key.id, key.team_id)
            return JSONResponse(views.sandbox(rec, ctx.domain), status_code=201)
        if len(idem_key) > 256:
            raise ApiError(400, "Idempotency-Key is longer than 256 characters")
        digest = hashlib.sha256(json.dumps(body.model_dump(), sort_keys=True).encode()).hexdigest()
        store = mgr.store
        slot = (key.id, idem_key)
        lock = ctx._idem_locks.setdefault(slot, asyncio.Lock())
        try:
            async with lock:
                await store.expire_idempotency(time.time() - IDEMPOTENCY_TTL_S)
                # The claim is the atomic step; the lock only spares waiters a 409.
                if not await store.claim_idempotency(key.id, idem_key, digest):
                    seen = await store.idempotency(key.id, idem_key)
                    if seen is None or seen[0] != digest:
                        raise ApiError(409, "Idempotency-Key was already used with another body")
                    prior = await store.get(seen[1]) if seen[1] else None
                    if prior is None:
                        raise ApiError(409, "Idempotency-Key belongs to a create in progress")
                    return JSONResponse(views.sandbox(prior, ctx.domain), status_code=201)
                try:
                    rec = await mgr.create(spec, key.id, key.team_id)
                except BaseException:
                    await store.release_idempotency(key.id, idem_key)
                    raise
                await store.complete_idempotency(key.id, idem_key, rec.id)
        finally:
            if not lock.locked():
                ctx._idem_locks.pop(slot, None)
        return JSONResponse(views.sandbox(rec, ctx.domain), status_code=201)

    @app.post("/v2/sandboxes", status_code=201, tags=["sandboxes"])
    async def create_v2(
        body: NewSandbox,
        key: Auth,
        idempotency_key: Annotated[str | None, Header()] = None,
        x_capacity_wait: Annotated[str | None, Header()] = None,
    ) -> JSONResponse:
        return await create(body, key, idempotency_key, x_capacity_wait, v2=True)

    @app.post("/sandboxes", status_code=201, tags=["sandboxes"])
    async def create_v1(
        body: NewSandbox,
        key: Auth,
        idempotency_key: Annotated[str | None, Header()] = None,
        x_capacity_wait: Annotated[str | None, Header()] = None,
    ) -> JSONResponse:
        return await create(body, key, idempotency_key, x_capacity_wait, v2=False)


def _capacity_wait(field: int | None, header: str | None) -> float | None:
    """The create's own wait for capacity, from the body field or the header (SDKs can add
    headers to a create, not body fields); None: the server's default."""
    if header is None:
        return None if field is None else float(field)
    if field is not None:
        raise ApiError(400, "capacityWait and X-Capacity-Wait both given: send one")
    try:
        seconds = int(header.strip())
    except ValueError:
        seconds = -1
    if not 0 <= seconds <= MAX_CAPACITY_WAIT_S:
        raise ApiError(
            400, f"X-Capacity-Wait must be whole seconds from 0 to {MAX_CAPACITY_WAIT_S}"
        )
    return float(seconds)


# Egress policy this server does not enforce yet: refused by name, never stored and ignored.
_UNENFORCED_NETWORK = (
    "egressProxy",
    "rules",
)


def refuse_unenforced(body: NewSandbox, network: dict[str, object]) -> None:
    named = [f"network.{k}" for k in _UNENFORCED_NETWORK if k in network]
    if named:
        raise ApiError(400, f"{', '.join(named)}: not enforced by this server yet")
    try:
        check_ingress(network)
    except BadIngress as exc:
        raise ApiError(400, str(exc)) from exc
    if body.iam is not None:
        raise ApiError(400, "iam: workload identity is not supported by this server")
    if body.network is not None:
        net = body.network
        check_targets("network.", net.allowOut, net.denyOut, net.dnsServers)


def check_targets(
    prefix: str, allow: list[str] | None, deny: list[str] | None, dns: list[str] | None
) -> None:
    """allowOut/denyOut entries are IPv4 CIDRs, addresses or domain names, dnsServers IPv4
    addresses; anything else is a 400 naming the entry."""
    try:
        Egress.of(allow_out=allow or [], deny_out=deny or [], dns_servers=dns, prefix=prefix)
    except BadTarget as exc:
        raise ApiError(400, str(exc)) from exc
