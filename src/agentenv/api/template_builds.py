"""`TemplateBuilds`: the template build API's state and the steps its routes share: a
team's template, signed upload links, a template's view and builds, refusing or carrying out a
delete (releasing its snapshots and images). Split from `templates.py`, which mounts the
routes; other API modules use this object."""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import re
import secrets
from typing import Any

from fastapi.responses import JSONResponse

from agentenv.api import views
from agentenv.api.errors import error
from agentenv.api.tenancy import Tenancy, template_team
from agentenv.build.builder import Builder
from agentenv.build.state import BuildRecord, BuildState, TemplateRecord, builds_dir
from agentenv.build.templates import (
    DEFAULT_TAG,
    NO_BUILD,
    BuiltTemplates,
    image_template_name,
)
from agentenv.config import Settings
from agentenv.contract.runtime import SnapshotFiles, TemplateUnavailable
from agentenv.control.store import BUILD_METADATA, LIVE_STATES, SandboxState

log = logging.getLogger("agentenv.build")

STATUS_PAGE = 100
NAME_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{0,62}$")
HASH_RE = re.compile(r"^[A-Za-z0-9]{1,128}$")
REQUEST_FIELDS = ("name", "alias", "tags", "cpuCount", "memoryMB", "minFreeDiskMb", "teamID")


class TemplateBuilds:
    """State, builder and upload signing for one control app."""

    def __init__(self, ctx: Any, settings: Settings) -> None:
        self.ctx = ctx
        self.settings = settings
        built = ctx.templates
        if not isinstance(built, BuiltTemplates):
            # A context not made by `server.build_runtime`: the same wrapping, so the API
            # and the sandbox manager resolve `name:tag` alike.
            files = built if isinstance(built, SnapshotFiles) else None
            lookup = files.snapshot_id if files is not None else None
            state = BuildState(builds_dir(settings.home), snapshot_lookup=lookup)
            built = BuiltTemplates(built, state, files)
            ctx.templates = ctx.manager.templates = built
        self.built: BuiltTemplates = built
        self.state = built.state
        self.tenancy = Tenancy(ctx.manager.store, built)
        # A cluster's replica (its lease): who runs a build, and who is still alive.
        replica = ctx.manager.replicas
        self.builder = Builder(
            ctx.manager,
            settings,
            self.state,
            runner=replica.replica_id if replica is not None else None,
            live_runners=replica.live if replica is not None else None,
            shared=built.shared,
        )
        # Upload links are signed, not authenticated: the SDK sends no API key with them. A
        # cluster's replicas share the key (a link one signs, another accepts), derived from
        # the secret they already share.
        if settings.etcd_endpoints and settings.node_token:
            self._secret = hashlib.sha256(
                b"agentenv upload links\n" + settings.node_token.encode()
            ).digest()
        else:
            self._secret = secrets.token_bytes(32)

    async def start(self) -> None:
        await self.builder.start()

    async def close(self) -> None:
        await self.builder.close()
        await self.state.close()

    async def owned(self, template_id: str, team_id: str) -> TemplateRecord | None:
        """The team's built template of that id; another team's is None (a 404)."""
        tpl = await self.state.template(template_id)
        return tpl if tpl is not None and template_team(tpl) == team_id else None

    def sign(self, template_id: str, files_hash: str, expires: int) -> str:
        msg = f"{template_id}\n{files_hash}\n{expires}".encode()
        return hmac.new(self._secret, msg, hashlib.sha256).hexdigest()

    # -- built templates as E2B shows them -------------------------------------------------

    async def template_view(
        self, tpl: TemplateRecord, spawns: dict[str, tuple[int, float]]
    ) -> dict[str, Any]:
        """E2B's `Template`: the shape, disk and envd of the ready build the default tag
        names (zeros and the nil buildID if none), the status of the newest build asked to
        carry the default tag."""
        default: BuildRecord | None = None
        with contextlib.suppress(TemplateUnavailable):
            default = await self.built.build_for(tpl, None)
        snap = await self.built.snapshot_of(default) if default is not None else None
        newest = None
        for bid in reversed(tpl.builds):
            b = await self.state.build(bid)
            if b is not None and DEFAULT_TAG in b.tags:
                newest = b
                break
        return views.built_template(
            tpl.template_id,
            build_id=default.build_id if default is not None and snap is not None else NO_BUILD,
            snapshot=snap,
            disk_mb=snap.size_mb if snap is not None else 0,
            created_at=tpl.created_at,
            updated_at=tpl.updated_at,
            spawns=spawns.get(tpl.template_id),
            build_count=len(tpl.builds),
            build_status=newest.status if newest is not None else "waiting",
        )

    async def build_rows(self, tpl: TemplateRecord) -> list[dict[str, Any]]:
        """E2B's `TemplateBuild`s, newest first."""
        rows = []
        for bid in reversed(tpl.builds):
            rec = await self.state.build(bid)
            if rec is None:
                continue
            snap = await self.built.snapshot_of(rec) if rec.status == "ready" else None
            rows.append(
                views.template_build(
                    rec,
                    snap,
                    disk_mb=snap.size_mb if snap is not None else None,
                    cpu=rec.cpu or self.settings.default_cpu,
                    memory_mb=rec.memory_mb or self.settings.default_memory_mb,
                )
            )
        return rows

    # -- delete ----------------------------------------------------------------------------

    async def refuse_delete(self, tpl: TemplateRecord) -> JSONResponse | None:
        """E2B's rule: not while running or paused sandboxes use it; ours too: not while one
        of its builds runs (its sandbox would capture into a template that is gone)."""
        users = [
            r
            for r in await self.ctx.manager.store.select(LIVE_STATES)
            if r.template == tpl.template_id and BUILD_METADATA not in r.metadata
        ]
        name = tpl.template_id
        if any(r.state is not SandboxState.PAUSED for r in users):
            return error(
                400, f"cannot delete template '{name}' because there are running sandboxes using it"
            )
        if users:
            return error(
                400, f"cannot delete template '{name}' because there are paused sandboxes using it"
            )
        # A build in progress is `building` wherever it runs (here or on another replica).
        for bid in tpl.builds:
            rec = await self.state.build(bid)
            if self.builder.running(bid) or (rec is not None and rec.status == "building"):
                return error(409, f"cannot delete template '{name}' while one of its builds runs")
        return None

    async def delete_template(self, tpl: TemplateRecord) -> None:
        """Drops the template (no create resolves it from here on), then what only it held:
        the snapshots of its builds that no other template's build uses, and the image it
        was built from if no other template's build and no sandbox uses that. What still
        runs from any of it keeps its own disk layers and memory mapping (the layer store
        and the snapshot holders protect them); the step cache stays."""
        await self.state.drop_template(tpl.template_id)
        others = [
            b
            for t in await self.state.templates()
            for b in [await self.state.build(bid) for bid in t.builds]
            if b is not None
        ]
        mine = [b for b in [await self.state.build(bid) for bid in tpl.builds] if b is not None]
        kept = {b.snapshot_id for b in others}
        snapshots = {b.snapshot_id for b in mine if b.snapshot_id and b.snapshot_id not in kept}
        theirs = {_image_of(b) for b in others}
        live = {r.template for r in await self.ctx.manager.store.select(LIVE_STATES)}
        images = {i for b in mine if (i := _image_of(b)) and i not in theirs and i not in live}
        ours = {b.snapshot_id for b in mine if b.snapshot_id}
        files = self.built.files
        if files is not None and not self.built.shared:
            # Builds before tags resolved through the records named their snapshot too; the
            # name would go on resolving, to the catalog's snapshot, if left.
            legacy = await files.details(tpl.template_id)
            if legacy is not None and legacy.snapshot_id in ours:
                await files.remove_name(tpl.template_id)
        # Through the runtime: on one server its repository and catalog; in a cluster every
        # node's copy and the bucket's, and the catalogs of the nodes that imported the image.
        runtime = self.ctx.manager.runtime
        for sid in sorted(snapshots):
            try:
                await runtime.delete_snapshot(sid)
            except Exception as exc:
                log.warning("template %s: snapshot %s not deleted: %s",
                            tpl.template_id, sid, exc)  # fmt: skip
        for image in sorted(images):
            try:
                await runtime.remove_image(image)
            except Exception as exc:
                log.warning("template %s: image %s not removed: %s",
                            tpl.template_id, image, exc)  # fmt: skip
        for b in mine:
            await self.state.drop_build(b.build_id)


def _image_of(rec: BuildRecord) -> str | None:
    ref = (rec.spec or {}).get("fromImage")
    return image_template_name(ref) if isinstance(ref, str) else None


def settings_of(ctx: Any) -> Settings:
    found = getattr(ctx.templates, "settings", None)
    return found if isinstance(found, Settings) else Settings.from_env()
