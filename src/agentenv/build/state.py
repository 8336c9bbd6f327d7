"""Builds and the templates they belong to: the records, their logs and the uploaded files.

`BuildStore` is what the build API, the builder and name resolution use. `BuildState` keeps it
on disk under `<home>/template-builds/` (one server); `build.shared_state.EtcdBuildState` keeps
it in etcd and object storage, shared by every control-plane replica of a cluster.

On disk: `templates.json` holds every template made through the build API (id = its name, its
tags → build ids); `builds/<id>.json` one build (status, reason, the sandbox it runs in),
`builds/<id>.log` its log as JSON lines; `files/<hash>.tar` the uploaded COPY contexts;
`snapshot-names.json` the builder's own snapshot names (step cache, captured templates) → ids.
Records are rewritten whole through a rename, so a crash leaves the old or the new one.

Writes that read first (`update_template`, `put_build(expect_status=)`) are atomic: two
requests (or two replicas) changing one template never lose each other's change, and of two
starts of one build exactly one moves it out of `waiting`.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

LEVELS = ("debug", "info", "warn", "error")


@dataclass
class TemplateRecord:
    template_id: str
    name: str
    created_at: float
    updated_at: float
    # tag → build id (the default tag is "latest").
    tags: dict[str, str] = field(default_factory=dict)
    builds: list[str] = field(default_factory=list)
    cpu: int | None = None
    memory_mb: int | None = None
    # The owning team (None: a record from before teams, the default team's).
    team_id: str | None = None


@dataclass
class BuildRecord:
    build_id: str
    template_id: str
    # waiting (requested, not started) → building → ready | error
    status: str
    created_at: float
    tags: list[str] = field(default_factory=list)
    cpu: int | None = None
    memory_mb: int | None = None
    finished_at: float | None = None
    reason: dict[str, Any] | None = None
    sandbox_id: str | None = None
    snapshot_id: str | None = None
    spec: dict[str, Any] | None = None
    # The captured template's shape (a ready build's), so a replica that does not hold the
    # snapshot's files still answers with it.
    snapshot_cpu: int | None = None
    snapshot_memory_mb: int | None = None
    snapshot_envd_version: str | None = None
    # The control-plane replica running the build (a cluster's; None on one server).
    runner: str | None = None


@dataclass(frozen=True)
class LogLine:
    timestamp: float
    level: str
    message: str
    step: str | None = None

    def wire(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "timestamp": datetime.fromtimestamp(self.timestamp, UTC).isoformat(),
            "level": self.level,
            "message": self.message,
        }
        if self.step is not None:
            body["step"] = self.step
        return body


# A change to a template record: gets the stored one (None: there is none), returns what to
# store (None: leave it as it is).
TemplateChange = Callable[[TemplateRecord | None], TemplateRecord | None]


class BuildStore(Protocol):
    async def template(self, template_id: str) -> TemplateRecord | None: ...

    async def templates(self) -> list[TemplateRecord]: ...

    async def update_template(
        self, template_id: str, change: TemplateChange
    ) -> TemplateRecord | None:
        """Applies `change` to the stored record atomically; returns what is stored after."""
        ...

    async def drop_template(self, template_id: str) -> TemplateRecord | None: ...

    async def build(self, build_id: str) -> BuildRecord | None: ...

    async def builds(self) -> list[BuildRecord]: ...

    async def put_build(self, rec: BuildRecord, *, expect_status: str | None = None) -> bool:
        """Stores `rec`; with `expect_status`, only if the stored build has that status
        (False: it has not, nothing was written)."""
        ...

    async def drop_build(self, build_id: str) -> None: ...

    def log(
        self, build_id: str, message: str, level: str = "info", step: str | None = None
    ) -> None:
        """Appends a log line (from the event loop's thread); `flush_logs` makes it durable
        for every reader."""
        ...

    async def flush_logs(self, build_id: str) -> None: ...

    async def logs(self, build_id: str) -> list[LogLine]: ...

    async def has_files(self, files_hash: str) -> bool: ...

    async def put_files(self, files_hash: str, path: Path) -> None:
        """Takes the uploaded archive at `path` (moved or removed) as `files_hash`."""
        ...

    async def files(self, files_hash: str) -> Path | None:
        """A local copy of the uploaded archive, fetched if needed; None if never uploaded."""
        ...

    def staging(self) -> Path:
        """A directory for uploads in progress (same file system as the local copies)."""
        ...

    async def snapshot_named(self, name: str) -> str | None:
        """The id of the builder's snapshot `name` (step cache, captured template), if kept."""
        ...

    async def name_snapshot(self, name: str, snapshot_id: str) -> None: ...

    async def is_builder_snapshot(self, snapshot_id: str) -> bool:
        """Whether the builder recorded `snapshot_id` under one of its names."""
        ...

    async def close(self) -> None: ...


def builds_dir(home: Path) -> Path:
    return home / "template-builds"


def _write(path: Path, data: object) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
    os.replace(tmp, path)


def template_from(raw: dict[str, Any]) -> TemplateRecord:
    return TemplateRecord(**raw)


def build_from(raw: dict[str, Any]) -> BuildRecord:
    return BuildRecord(**raw)


def log_row(line: LogLine) -> list[Any]:
    return [line.timestamp, line.level, line.message, line.step]


def parse_log_rows(text: str) -> list[LogLine]:
    lines: list[LogLine] = []
    for row in text.splitlines():
        try:
            ts, level, message, step = json.loads(row)
        except ValueError:
            continue  # a line a crash cut short
        lines.append(LogLine(ts, level, message, step))
    return lines


class BuildState:
    """The `BuildStore` of one server, on disk. Files are small and local: the calls do
    their IO inline, under one thread lock (uploads write from worker threads)."""

    def __init__(self, root: Path, snapshot_lookup: Callable[[str], str | None] | None = None):
        self.root = root
        self.builds_dir = root / "builds"
        self.files_dir = root / "files"
        self.builds_dir.mkdir(parents=True, exist_ok=True)
        self.files_dir.mkdir(parents=True, exist_ok=True)
        # The snapshot repository is what knows the builder's snapshot names on one server
        # (a deleted snapshot is not found); without one, the names file does.
        self._snapshot_lookup = snapshot_lookup
        self._lock = threading.Lock()
        self._logs: dict[str, list[LogLine]] = {}

    # -- templates -------------------------------------------------------------------------

    def _templates(self) -> dict[str, TemplateRecord]:
        path = self.root / "templates.json"
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            return {}
        return {k: template_from(v) for k, v in raw.items()}

    def _save_templates(self, rows: dict[str, TemplateRecord]) -> None:
        _write(self.root / "templates.json", {k: asdict(v) for k, v in rows.items()})

    async def template(self, template_id: str) -> TemplateRecord | None:
        with self._lock:
            return self._templates().get(template_id)

    async def templates(self) -> list[TemplateRecord]:
        with self._lock:
            return list(self._templates().values())

    async def update_template(
        self, template_id: str, change: TemplateChange
    ) -> TemplateRecord | None:
        with self._lock:
            rows = self._templates()
            new = change(rows.get(template_id))
            if new is None:
                return rows.get(template_id)
            rows[template_id] = new
            self._save_templates(rows)
            return new

    async def drop_template(self, template_id: str) -> TemplateRecord | None:
        with self._lock:
            rows = self._templates()
            rec = rows.pop(template_id, None)
            if rec is not None:
                self._save_templates(rows)
        return rec

    # -- builds ----------------------------------------------------------------------------

    def _build(self, build_id: str) -> BuildRecord | None:
        try:
            raw = json.loads((self.builds_dir / f"{build_id}.json").read_text())
        except (FileNotFoundError, ValueError):
            return None
        return build_from(raw)

    async def build(self, build_id: str) -> BuildRecord | None:
        return self._build(build_id)

    async def builds(self) -> list[BuildRecord]:
        rows = []
        for path in sorted(self.builds_dir.glob("*.json")):
            rec = self._build(path.stem)
            if rec is not None:
                rows.append(rec)
        return rows

    async def put_build(self, rec: BuildRecord, *, expect_status: str | None = None) -> bool:
        with self._lock:
            if expect_status is not None:
                current = self._build(rec.build_id)
                if current is None or current.status != expect_status:
                    return False
            _write(self.builds_dir / f"{rec.build_id}.json", asdict(rec))
        return True

    async def drop_build(self, build_id: str) -> None:
        for suffix in (".json", ".log"):
            (self.builds_dir / f"{build_id}{suffix}").unlink(missing_ok=True)
        self._logs.pop(build_id, None)

    # -- logs ------------------------------------------------------------------------------

    def _loaded(self, build_id: str) -> list[LogLine]:
        if build_id not in self._logs:
            try:
                text = (self.builds_dir / f"{build_id}.log").read_text()
            except FileNotFoundError:
                text = ""
            self._logs[build_id] = parse_log_rows(text)
        return self._logs[build_id]

    def log(
        self, build_id: str, message: str, level: str = "info", step: str | None = None
    ) -> None:
        line = LogLine(time.time(), level, message, step)
        self._loaded(build_id).append(line)
        with (self.builds_dir / f"{build_id}.log").open("a") as f:
            f.write(json.dumps(log_row(line)) + "\n")

    async def flush_logs(self, build_id: str) -> None:
        return None  # every line is in the file as it is logged

    async def logs(self, build_id: str) -> list[LogLine]:
        return list(self._loaded(build_id))

    # -- uploaded files --------------------------------------------------------------------

    def files_path(self, files_hash: str) -> Path:
        return self.files_dir / f"{files_hash}.tar"

    async def has_files(self, files_hash: str) -> bool:
        return self.files_path(files_hash).exists()

    async def put_files(self, files_hash: str, path: Path) -> None:
        await asyncio.to_thread(os.replace, path, self.files_path(files_hash))

    async def files(self, files_hash: str) -> Path | None:
        path = self.files_path(files_hash)
        return path if path.exists() else None

    def staging(self) -> Path:
        return self.files_dir

    # -- the builder's snapshot names ------------------------------------------------------

    async def snapshot_named(self, name: str) -> str | None:
        if self._snapshot_lookup is not None:
            return await asyncio.to_thread(self._snapshot_lookup, name)
        with self._lock:
            try:
                names = json.loads((self.root / "snapshot-names.json").read_text())
            except FileNotFoundError:
                return None
        found = names.get(name)
        return found if isinstance(found, str) else None

    async def name_snapshot(self, name: str, snapshot_id: str) -> None:
        if self._snapshot_lookup is not None:
            return  # the repository holds the name already (the snapshot was taken with it)
        with self._lock:
            path = self.root / "snapshot-names.json"
            try:
                names = json.loads(path.read_text())
            except FileNotFoundError:
                names = {}
            names[name] = snapshot_id
            _write(path, names)

    async def is_builder_snapshot(self, snapshot_id: str) -> bool:
        with self._lock:
            try:
                names = json.loads((self.root / "snapshot-names.json").read_text())
            except FileNotFoundError:
                return False
        return snapshot_id in names.values()

    async def close(self) -> None:
        return None


def _check(s: BuildState) -> BuildStore:
    return s
