"""The template catalog: which disk layers (and later, snapshots) make up each template.

Persisted as one JSON file (``settings.templates_file``), rewritten atomically under an
exclusive lock so concurrent CLI and server processes never see a half-written catalog.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from agentenv.config import Settings
from agentenv.template.errors import CatalogError, TemplateNotFound

__all__ = ["Template", "TemplateCatalog", "TemplateNotFound", "validate_name"]

NAME_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{0,62}$")
DIGEST_RE = re.compile(r"^[0-9a-f]{64}$")


def validate_name(name: str) -> str:
    if not NAME_RE.match(name):
        raise CatalogError(
            f"invalid template name {name!r}: use 1-63 of a-z 0-9 . _ -, starting alphanumeric"
        )
    return name


@dataclass
class Template:
    name: str
    layers: list[str]  # layer digests, bottom → top
    size_mb: int
    created_at: float = field(default_factory=time.time)
    build_key: str = ""  # hash of the inputs it was built from; "" when imported
    # Memory snapshot of a booted template (filled in by the snapshot work).
    snapshot: dict[str, Any] | None = None
    # Defaults for commands in its sandboxes (an image's config, `template.image`); a
    # catalog written before these existed reads as "none": envd's own defaults.
    source: str = ""  # the image reference, pinned to its manifest digest
    env: dict[str, str] = field(default_factory=dict)
    workdir: str | None = None
    user: str | None = None
    entrypoint: list[str] = field(default_factory=list)
    cmd: list[str] = field(default_factory=list)
    exposed_ports: list[str] = field(default_factory=list)  # "8080/tcp"

    def __post_init__(self) -> None:
        validate_name(self.name)
        for d in self.layers:
            if not DIGEST_RE.match(d):
                raise CatalogError(f"template {self.name!r}: {d!r} is not a layer digest")
        if self.size_mb <= 0:
            raise CatalogError(f"template {self.name!r}: size_mb must be positive")
        if not isinstance(self.env, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in self.env.items()
        ):
            raise CatalogError(f"template {self.name!r}: env must map strings to strings")
        for what, value in (("workdir", self.workdir), ("user", self.user)):
            if value is not None and (not isinstance(value, str) or not value):
                raise CatalogError(f"template {self.name!r}: {what} must be a non-empty string")
        if self.workdir is not None and not self.workdir.startswith("/"):
            raise CatalogError(f"template {self.name!r}: workdir {self.workdir!r} is not absolute")
        for what, items in (
            ("entrypoint", self.entrypoint),
            ("cmd", self.cmd),
            ("exposed_ports", self.exposed_ports),
        ):
            if not isinstance(items, list) or not all(isinstance(x, str) for x in items):
                raise CatalogError(f"template {self.name!r}: {what} must be a list of strings")

    @property
    def has_defaults(self) -> bool:
        """Whether a sandbox of it needs envd `/init` with the template's defaults."""
        return bool(self.env) or self.workdir is not None or self.user is not None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> Template:
        # Unknown keys come from newer versions of agentenv; keep reading what we know.
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in raw.items() if k in known})


class TemplateCatalog:
    def __init__(self, settings: Settings) -> None:
        self.path = settings.templates_file

    def get(self, name: str) -> Template:
        templates = self._read()
        if name not in templates:
            raise TemplateNotFound(name, list(templates))
        return templates[name]

    def list(self) -> list[Template]:
        return sorted(self._read().values(), key=lambda t: t.name)

    def put(self, template: Template) -> None:
        with self._locked() as templates:
            templates[template.name] = template

    def delete(self, name: str) -> Template:
        with self._locked() as templates:
            if name not in templates:
                raise TemplateNotFound(name, list(templates))
            return templates.pop(name)

    def _read(self) -> dict[str, Template]:
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return {}
        except OSError as exc:
            raise CatalogError(f"cannot read the template catalog {self.path}: {exc}") from exc
        return self._parse(text)

    def _parse(self, text: str) -> dict[str, Template]:
        if not text.strip():
            return {}
        try:
            raw = json.loads(text)
            entries = raw["templates"]
            return {e["name"]: Template.from_dict(e) for e in entries}
        except (ValueError, KeyError, TypeError) as exc:
            raise CatalogError(f"template catalog {self.path} is corrupt: {exc}") from exc

    @contextlib.contextmanager
    def _locked(self) -> Iterator[dict[str, Template]]:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        lock_path = self.path.with_name(self.path.name + ".lock")
        with open(lock_path, "a+") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            templates = self._read()
            yield templates
            self._write(templates)

    def _write(self, templates: dict[str, Template]) -> None:
        doc = {
            "version": 1,
            "templates": [t.to_dict() for t in sorted(templates.values(), key=lambda t: t.name)],
        }
        fd, tmp = tempfile.mkstemp(prefix=".templates-", dir=self.path.parent)
        try:
            with os.fdopen(fd, "w") as fh:
                json.dump(doc, fh, indent=2)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
