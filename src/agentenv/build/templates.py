"""Built templates as a `TemplateSource`: what `name` and `name:tag` mean.

A template made through the build API is a record (`BuildState`: tags → build ids), not a
snapshot name: snapshot names cannot hold `:`, and one template has a build per tag. A
reference resolves as E2B's `id.ParseName` + `GetTemplateWithBuildByTag` do: `name` is
`name:default`; the tag names one build, which must be `ready`; a tag that is a build id
names that build if some tag still points at it. The build's snapshot id is what the
runtime creates from (`TemplateInfo.ref`), and the sandbox reports the template's name as
its templateID and alias (E2B reports the template, not the tag).

Everything that is not a built template's name goes to the wrapped source (the catalog and
snapshots, which never have tags). A built template's name wins over a snapshot named the
same (the snapshot route refuses such names).

The builder's own snapshots (the step cache `build-cache-*`, the captured templates
`build-final-*`) are internal: the API does not list them and does not let users create
from, build from or delete them by name or id (`internal`).
"""

from __future__ import annotations

import hashlib
import re
import uuid
from dataclasses import dataclass, replace

from agentenv.build.state import BuildRecord, BuildStore, TemplateRecord
from agentenv.contract.runtime import (
    SNAPSHOT_ID,
    SnapshotDetails,
    SnapshotFiles,
    TagUnavailable,
    TemplateInfo,
    TemplateSource,
    TemplateUnavailable,
)

# E2B's: `name` alone means this tag; it is given to a build that names no tag, and it
# cannot be removed.
DEFAULT_TAG = "default"
# E2B's tag rule (lowercased first); the length bound is ours.
_TAG_RE = re.compile(r"^[a-z0-9_.-]{1,128}$")
INTERNAL_PREFIXES = ("build-cache-", "build-final-")
# E2B's buildID of a template no ready build carries the default tag of.
NO_BUILD = "00000000-0000-0000-0000-000000000000"


class BadTag(ValueError):
    pass


class TagNotFound(TagUnavailable):
    def __init__(self, name: str, tag: str) -> None:
        super().__init__(f"tag '{tag}' does not exist for template '{name}'")
        self.name = name
        self.tag = tag


def _is_uuid(text: str) -> bool:
    try:
        uuid.UUID(text)
    except ValueError:
        return False
    return True


def split_name(raw: str) -> tuple[str, str | None]:
    """`name[:tag]` → (name, tag); the tag lowercased, None for no tag or `default`."""
    name, sep, tag = raw.strip().partition(":")
    tag = tag.strip().lower()
    return name, (tag if sep and tag != DEFAULT_TAG else None)


def clean_tags(tags: list[str]) -> list[str]:
    """Tags as E2B stores them: trimmed, lowercased, checked, deduplicated (first kept)."""
    out: list[str] = []
    for raw in tags:
        tag = raw.strip().lower()
        if not _TAG_RE.match(tag):
            raise BadTag(f"tag {raw!r}: use 1-128 of a-z 0-9 . _ -")
        if _is_uuid(tag):
            raise BadTag(f"tag {raw!r}: a tag cannot be a UUID (build ids are)")
        if tag not in out:
            out.append(tag)
    return out


def image_template_name(ref: str) -> str:
    """The catalog template a build's `fromImage` is imported as (shared by every build of
    the same reference)."""
    return "image-" + hashlib.sha256(ref.encode()).hexdigest()[:24]


def is_internal_name(name: str) -> bool:
    return name.startswith(INTERNAL_PREFIXES)


@dataclass(frozen=True)
class BuiltShape:
    """What a ready build's template is: its snapshot and the shape captured in it."""

    snapshot_id: str
    cpu: int
    memory_mb: int
    envd_version: str
    # The template's disk; 0 where it is not known here (the snapshot is on other nodes).
    size_mb: int


class BuiltTemplates:
    """`inner` (the catalog and snapshots) plus the templates of the build API.

    `files`: the snapshots of this host (a single-node server's, through the contract's
    `SnapshotFiles`). `shared`: a cluster's control plane, whose snapshots live on the nodes
    and in the bucket, not on this replica's host; a ready build's shape is then the one its
    record kept.
    """

    def __init__(
        self,
        inner: TemplateSource,
        state: BuildStore,
        files: SnapshotFiles | None,
        *,
        shared: bool = False,
    ) -> None:
        self.inner = inner
        self.state = state
        self.files = files
        self.shared = shared
        # The wrapped source's settings, where it has them (`api.templates` reads them).
        self.settings: object = getattr(inner, "settings", None)

    # -- resolution ------------------------------------------------------------------------

    async def build_for(self, tpl: TemplateRecord, tag: str | None) -> BuildRecord:
        """The ready build `tag` (None: the default) of `tpl` names; `TagNotFound` if none."""
        tag = tag or DEFAULT_TAG
        if _is_uuid(tag):
            bid: str | None = tag if tag in tpl.tags.values() else None
        else:
            bid = tpl.tags.get(tag)
        rec = await self.state.build(bid) if bid is not None else None
        if rec is None or rec.status != "ready" or rec.snapshot_id is None:
            raise TagNotFound(tpl.name, tag)
        return rec

    async def snapshot_of(self, build: BuildRecord) -> BuiltShape | None:
        if build.snapshot_id is None:
            return None
        if self.shared:
            if build.snapshot_cpu is None or build.snapshot_memory_mb is None:
                return None
            return BuiltShape(
                build.snapshot_id,
                build.snapshot_cpu,
                build.snapshot_memory_mb,
                build.snapshot_envd_version or "",
                0,
            )
        snap = await self.snapshot_details(build.snapshot_id)
        if snap is None:
            return None
        return BuiltShape(snap.snapshot_id, snap.cpu, snap.memory_mb, snap.envd_version,
                          snap.size_mb)  # fmt: skip

    async def snapshot_details(self, ref: str) -> SnapshotDetails | None:
        """The snapshot `ref` names on this host (id or name); None if none, or no host's."""
        if self.shared or self.files is None:
            return None
        return await self.files.details(ref)

    async def get(self, name: str) -> TemplateInfo:
        base, tag = split_name(name)
        tpl = await self.state.template(base)
        if tpl is None:
            if tag is not None:
                # Only built templates have tags (catalog and snapshot names cannot).
                raise TemplateUnavailable(f"template {base!r} not found")
            found = await self.inner.get(base)
            return replace(found, template_id=found.template_id or base)
        build = await self.build_for(tpl, tag)
        shape = await self.snapshot_of(build)
        if shape is None:
            raise TemplateUnavailable(f"template {name!r}: the snapshot of build "
                                      f"{build.build_id} is gone")  # fmt: skip
        return TemplateInfo(
            name=tpl.name,
            size_mb=shape.size_mb,
            created_at=tpl.created_at,
            updated_at=tpl.updated_at,
            cpu=shape.cpu,
            memory_mb=shape.memory_mb,
            ref=shape.snapshot_id,
            template_id=tpl.template_id,
        )

    async def list(self) -> list[TemplateInfo]:
        """The wrapped source's templates (built ones are listed from their records)."""
        return await self.inner.list()

    async def delete(self, name: str) -> bool:
        """Not for built templates: the API checks their users first (`api.templates`)."""
        return await self.inner.delete(name)

    # -- the builder's own snapshots --------------------------------------------------------

    async def internal(self, ref: str) -> bool:
        """Whether `ref` names one of the builder's snapshots (by name, or by the id of a
        snapshot whose every name is the builder's)."""
        if is_internal_name(ref):
            return True
        if self.shared:
            # By id: the ids the builder recorded under its names.
            return SNAPSHOT_ID.fullmatch(ref) is not None and await self.state.is_builder_snapshot(
                ref
            )
        snap = await self.snapshot_details(ref)
        if snap is None:
            return False
        return (
            snap.snapshot_id == ref and bool(snap.names) and all(map(is_internal_name, snap.names))
        )
