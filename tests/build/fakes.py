"""In-memory stand-ins for what `build.templates` and the template routes read: a catalog
source and a snapshot repository (ids, names, holders; no files, no VM)."""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from agentenv.build.state import BuildRecord, BuildState, TemplateRecord
from agentenv.build.templates import BuiltTemplates
from agentenv.contract.runtime import SnapshotDetails, TemplateInfo, TemplateUnavailable
from agentenv.snapshot.errors import SnapshotNotFound
from agentenv.snapshot.model import Snapshot

T = TypeVar("T")


def now(coro: Coroutine[Any, Any, T]) -> T:
    """The result of a coroutine that never suspends (`BuildState`'s calls do their file IO
    inline), from sync and async tests alike."""
    try:
        coro.send(None)
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]
    coro.close()
    raise RuntimeError("the coroutine suspended: await it instead")


class FakeCatalog:
    """A TemplateSource with a fixed set of catalog templates."""

    def __init__(self, names: list[str], settings: object = None) -> None:
        self.names = list(names)
        self.settings = settings
        self.deleted: list[str] = []

    def info(self, name: str) -> TemplateInfo:
        if name not in self.names:
            raise TemplateUnavailable(name)
        return TemplateInfo(name, 1024, 1.0, 1.0, 1, 512)

    async def get(self, name: str) -> TemplateInfo:
        return self.info(name)

    async def list(self) -> list[TemplateInfo]:
        return [self.info(n) for n in self.names]

    async def delete(self, name: str) -> bool:
        if name not in self.names:
            return False
        self.names.remove(name)
        self.deleted.append(name)
        return True


@dataclass
class FakeRepo:
    snaps: dict[str, Snapshot] = field(default_factory=dict)
    deleted: list[str] = field(default_factory=list)

    def add(self, names: list[str], *, vcpus: int = 2, memory_mb: int = 768) -> Snapshot:
        sid = uuid.uuid4().hex
        snap = Snapshot(
            id=sid,
            layers=["a" * 64],
            vcpus=vcpus,
            memory_mb=memory_mb,
            balloon=True,
            tools_image="tools",
            accel="tcg",
            qemu_version="9",
            envd_version="0.6.4",
            memory_bytes=0,
            state_bytes=0,
            names=list(names),
        )
        self.snaps[sid] = snap
        return snap

    def get(self, ref: str) -> Snapshot:
        if ref in self.snaps:
            return self.snaps[ref]
        for snap in self.snaps.values():
            if ref in snap.names:
                return snap
        raise SnapshotNotFound(ref)

    def remove_name(self, name: str) -> Snapshot:
        snap = self.get(name)
        snap.names.remove(name)
        return snap

    def delete(self, ref: str) -> Snapshot:
        snap = self.get(ref)
        del self.snaps[snap.id]
        self.deleted.append(snap.id)
        return snap


@dataclass
class FakeFiles:
    """`SnapshotFiles` over a `FakeRepo` (no layer files: every disk is 100 MB)."""

    repo: FakeRepo

    async def details(self, ref: str) -> SnapshotDetails | None:
        try:
            s = self.repo.get(ref)
        except SnapshotNotFound:
            return None
        return SnapshotDetails(s.id, tuple(s.names), s.vcpus, s.memory_mb, s.envd_version, 100)

    def snapshot_id(self, name: str) -> str | None:
        try:
            return self.repo.get(name).id
        except SnapshotNotFound:
            return None

    async def remove_name(self, name: str) -> None:
        with contextlib.suppress(SnapshotNotFound):
            self.repo.remove_name(name)


def built_templates(home: Path, catalog: FakeCatalog, repo: FakeRepo) -> BuiltTemplates:
    files = FakeFiles(repo)
    state = BuildState(home / "template-builds", snapshot_lookup=files.snapshot_id)
    return BuiltTemplates(catalog, state, files)


def add_build(
    built: BuiltTemplates,
    repo: FakeRepo,
    name: str,
    tags: list[str],
    *,
    status: str = "ready",
    snapshot: Snapshot | None = None,
    spec: dict[str, object] | None = None,
) -> BuildRecord:
    """A build of `name` as the builder leaves it: ready ones have a snapshot and own their
    tags (`Builder._publish`)."""
    state = built.state
    tpl = now(state.template(name)) or TemplateRecord(name, name, time.time(), time.time())
    rec = BuildRecord(str(uuid.uuid4()), name, status, time.time(), tags=tags, spec=spec)
    if status == "ready":
        snap = snapshot or repo.add([f"build-final-{uuid.uuid4().hex[:40]}"])
        rec.snapshot_id = snap.id
        rec.finished_at = time.time()
        for tag in tags:
            tpl.tags[tag] = rec.build_id
    tpl.builds.append(rec.build_id)
    now(state.update_template(name, lambda _: tpl))
    now(state.put_build(rec))
    return rec
