"""What a team may see: its own sandboxes, built templates and snapshots, and the public ones.

E2B's model: every API key belongs to a team; sandboxes, templates (other than the public
ones) and snapshots are a team's. Anything of another team answers exactly as something that
does not exist (404 with the same message), so ids and names do not leak through a 403.

- Sandboxes: `SandboxRecord.team_id`, set at create from the key's team (a fork's children:
  the source's).
- Built templates (the build API): `TemplateRecord.team_id` (None in records from before
  teams: the default team's). One name space per server: a name another team's template
  holds is a 409 for a build request, not a second template of that name.
- Snapshots: `Store.snapshot_owner` (recorded when the snapshot route makes one; unrecorded
  = the default team's). Names are one name space too: naming a snapshot with a name
  another team's snapshot holds is a 409 (the name would otherwise move to it).
- Catalog templates (`base`, `docker`, what `aenv setup` registers) are public: every team
  lists and creates from them, only the default team (the server's operator) deletes them.
  The exception is an imported image's entry (`image-<hash of its reference>`, made by a
  build's `fromImage`, maybe with registry credentials): a team other than the default one
  sees it only if one of its own builds from that image is ready (so that team's pull
  passed the registry's check).
"""

from __future__ import annotations

import re

from agentenv.build.state import TemplateRecord
from agentenv.build.templates import BuiltTemplates, image_template_name, split_name
from agentenv.contract.errors import SandboxNotFound
from agentenv.contract.runtime import SNAPSHOT_ID
from agentenv.control.store import DEFAULT_TEAM, LIVE_STATES, SandboxRecord, Store

_SANDBOX_LABEL = re.compile(r'sandbox_id="([^"]*)"')
IMAGE_PREFIX = "image-"


def template_team(tpl: TemplateRecord) -> str:
    return tpl.team_id or DEFAULT_TEAM


class Tenancy:
    def __init__(self, store: Store, built: BuiltTemplates) -> None:
        self.store = store
        self.built = built

    # -- sandboxes -------------------------------------------------------------------------

    async def sandbox(self, sandbox_id: str, team_id: str) -> SandboxRecord | None:
        """The team's row of that id, or None (also when it is another team's)."""
        rec = await self.store.get(sandbox_id)
        return rec if rec is not None and rec.team_id == team_id else None

    async def check_sandbox(self, sandbox_id: str, team_id: str) -> None:
        """404 for an id the team does not own, as for one that never existed. A row's team
        never changes, so the row as this replica knows it (`Store.recent`) answers when it
        is known; the route reads the store for anything else it decides."""
        rec = self.store.recent(sandbox_id)
        if rec is not None and rec.team_id == team_id:
            return
        if await self.sandbox(sandbox_id, team_id) is None:
            raise SandboxNotFound(sandbox_id)

    # -- templates and snapshots -----------------------------------------------------------

    async def catalog_names(self) -> set[str]:
        return {t.name for t in await self.built.inner.list()}

    async def catalog_visible(self, name: str, team_id: str) -> bool:
        """Whether a catalog template is the team's to see (see the module's docstring)."""
        if not name.startswith(IMAGE_PREFIX) or team_id == DEFAULT_TEAM:
            return True
        state = self.built.state
        for tpl in await state.templates():
            if template_team(tpl) != team_id:
                continue
            for build_id in tpl.builds:
                rec = await state.build(build_id)
                if rec is None or rec.status != "ready":
                    continue
                ref = (rec.spec or {}).get("fromImage")
                if isinstance(ref, str) and image_template_name(ref) == name:
                    return True
        return False

    async def snapshot_team(self, ref: str) -> str | None:
        """The owner of the snapshot `ref` names (id or name), None if it names none."""
        if self.built.shared:
            # A cluster's snapshots are on its nodes: known here by id only.
            if not SNAPSHOT_ID.fullmatch(ref):
                return None
            return await self.store.snapshot_owner(ref)
        snap = await self.built.snapshot_details(ref)
        if snap is None:
            return None
        return await self.store.snapshot_owner(snap.snapshot_id)

    async def template_visible(self, ref: str, team_id: str) -> bool:
        """Whether `ref` (as a create's templateID) may be used by the team. A ref that
        names nothing is "visible": the normal path answers its 404."""
        name, tag = split_name(ref)
        tpl = await self.built.state.template(name)
        if tpl is not None:
            return template_team(tpl) == team_id
        if tag is not None:
            return True
        if name in await self.catalog_names():
            return await self.catalog_visible(name, team_id)
        owner = await self.snapshot_team(name)
        return owner is None or owner == team_id

    async def name_taken(self, name: str, team_id: str) -> bool:
        """Whether another team's template or snapshot holds `name`."""
        tpl = await self.built.state.template(name)
        if tpl is not None and template_team(tpl) != team_id:
            return True
        owner = await self.snapshot_team(name)
        return owner is not None and owner != team_id

    # -- metrics ---------------------------------------------------------------------------

    async def filter_metrics(self, text: str, team_id: str) -> str:
        """Prometheus text without the series of other teams' sandboxes (those labelled
        `sandbox_id`); node-wide series (counts, latencies) stay."""
        mine = {r.id for r in await self.store.select(LIVE_STATES, team_id=team_id)}
        out = []
        for line in text.splitlines():
            m = _SANDBOX_LABEL.search(line)
            if m is None or line.startswith("#") or m.group(1) in mine:
                out.append(line)
        return "\n".join(out) + "\n"
