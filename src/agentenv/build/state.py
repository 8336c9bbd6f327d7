"""Builds and the templates they belong to, on disk under `<home>/template-builds/`.

`templates.json` holds every template made through the build API (id = its name, its
tags → build ids); `builds/<id>.json` one build (status, reason, the sandbox it runs in),
`builds/<id>.log` its log as JSON lines; `files/<hash>.tar` the uploaded COPY contexts.
Records are rewritten whole through a rename, so a crash leaves the old or the new one.
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

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


def builds_dir(home: Path) -> Path:
    return home / "template-builds"


def _write(path: Path, data: object) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
    os.replace(tmp, path)


class BuildState:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.builds_dir = root / "builds"
        self.files_dir = root / "files"
        self.builds_dir.mkdir(parents=True, exist_ok=True)
        self.files_dir.mkdir(parents=True, exist_ok=True)
        # One process owns a data dir; the lock keeps threads (uploads) from interleaving.
        self._lock = threading.Lock()
        self._logs: dict[str, list[LogLine]] = {}

    # -- templates -------------------------------------------------------------------------

    def _templates(self) -> dict[str, TemplateRecord]:
        path = self.root / "templates.json"
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            return {}
        return {k: TemplateRecord(**v) for k, v in raw.items()}

    def _save_templates(self, rows: dict[str, TemplateRecord]) -> None:
        _write(self.root / "templates.json", {k: asdict(v) for k, v in rows.items()})

    def template(self, template_id: str) -> TemplateRecord | None:
        with self._lock:
            return self._templates().get(template_id)

    def templates(self) -> list[TemplateRecord]:
        with self._lock:
            return list(self._templates().values())

    def put_template(self, rec: TemplateRecord) -> None:
        with self._lock:
            rows = self._templates()
            rows[rec.template_id] = rec
            self._save_templates(rows)

    def drop_template(self, template_id: str) -> TemplateRecord | None:
        with self._lock:
            rows = self._templates()
            rec = rows.pop(template_id, None)
            if rec is not None:
                self._save_templates(rows)
        return rec

    # -- builds ----------------------------------------------------------------------------

    def build(self, build_id: str) -> BuildRecord | None:
        try:
            raw = json.loads((self.builds_dir / f"{build_id}.json").read_text())
        except (FileNotFoundError, ValueError):
            return None
        return BuildRecord(**raw)

    def builds(self) -> list[BuildRecord]:
        rows = []
        for path in sorted(self.builds_dir.glob("*.json")):
            rec = self.build(path.stem)
            if rec is not None:
                rows.append(rec)
        return rows

    def put_build(self, rec: BuildRecord) -> None:
        with self._lock:
            _write(self.builds_dir / f"{rec.build_id}.json", asdict(rec))

    def drop_build(self, build_id: str) -> None:
        for suffix in (".json", ".log"):
            (self.builds_dir / f"{build_id}{suffix}").unlink(missing_ok=True)
        self._logs.pop(build_id, None)

    # -- logs ------------------------------------------------------------------------------

    def log(
        self, build_id: str, message: str, level: str = "info", step: str | None = None
    ) -> None:
        line = LogLine(time.time(), level, message, step)
        self.logs(build_id).append(line)
        with (self.builds_dir / f"{build_id}.log").open("a") as f:
            f.write(json.dumps([line.timestamp, line.level, line.message, line.step]) + "\n")

    def logs(self, build_id: str) -> list[LogLine]:
        if build_id not in self._logs:
            lines: list[LogLine] = []
            try:
                text = (self.builds_dir / f"{build_id}.log").read_text()
            except FileNotFoundError:
                text = ""
            for row in text.splitlines():
                try:
                    ts, level, message, step = json.loads(row)
                except ValueError:
                    continue  # a line a crash cut short
                lines.append(LogLine(ts, level, message, step))
            self._logs[build_id] = lines
        return self._logs[build_id]

    # -- uploaded files --------------------------------------------------------------------

    def files_path(self, files_hash: str) -> Path:
        return self.files_dir / f"{files_hash}.tar"
