"""What a build request says, checked field by field.

`POST /v2/templates/{id}/builds/{build}` carries the SDK's serialized template
(`TemplateBuildStartV2`). Every field is either implemented or refused with a message that
names it: nothing is stored and ignored.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

STEP_TYPES = ("RUN", "COPY", "ENV", "ARG", "WORKDIR", "USER")
# `forceUpload`, `resolveSymlinks` and `gzip` steer the client's upload; the SDK may send
# them along (as extra step properties) and they do not change what the step does here.
_CLIENT_STEP_FIELDS = ("forceUpload", "resolveSymlinks", "gzip")
_STEP_FIELDS = ("type", "args", "filesHash", "force", *_CLIENT_STEP_FIELDS)
_BUILD_FIELDS = (
    "fromImage",
    "fromTemplate",
    "fromImageRegistry",
    "force",
    "steps",
    "startCmd",
    "readyCmd",
)


class SpecError(ValueError):
    """The request cannot be built; the message names the field."""


@dataclass(frozen=True)
class Credentials:
    username: str
    password: str


@dataclass(frozen=True)
class Step:
    type: str
    args: list[str]
    files_hash: str | None = None
    force: bool = False

    def identity(self) -> dict[str, Any]:
        # What the step cache hashes: what the step does, not how the client uploaded it.
        return {"type": self.type, "args": self.args, "filesHash": self.files_hash}


@dataclass(frozen=True)
class BuildSpec:
    from_image: str | None = None
    from_template: str | None = None
    credentials: Credentials | None = None
    force: bool = False
    steps: list[Step] = field(default_factory=list)
    start_cmd: str | None = None
    ready_cmd: str | None = None

    @property
    def base(self) -> str:
        return f"image:{self.from_image}" if self.from_image else f"template:{self.from_template}"

    def to_json(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "force": self.force,
            "steps": [dict(s.identity(), force=s.force) for s in self.steps],
        }
        if self.from_image:
            body["fromImage"] = self.from_image
        if self.from_template:
            body["fromTemplate"] = self.from_template
        if self.start_cmd is not None:
            body["startCmd"] = self.start_cmd
        if self.ready_cmd is not None:
            body["readyCmd"] = self.ready_cmd
        return body


def _string(value: object, where: str) -> str:
    if not isinstance(value, str):
        raise SpecError(f"{where}: must be a string")
    return value


def _flag(value: object, where: str) -> bool:
    if value is None:
        return False
    if not isinstance(value, bool):
        raise SpecError(f"{where}: must be a boolean")
    return value


def _registry(raw: object) -> Credentials:
    if not isinstance(raw, dict):
        raise SpecError("fromImageRegistry: must be an object")
    kind = raw.get("type")
    if kind in ("aws", "gcp"):
        raise SpecError(
            f"fromImageRegistry.type {kind!r}: cloud registry credentials are not supported "
            "by this server; use type 'registry' with username and password"
        )
    if kind != "registry":
        raise SpecError(f"fromImageRegistry.type {kind!r}: expected 'registry'")
    extra = sorted(set(raw) - {"type", "username", "password"})
    if extra:
        raise SpecError(f"fromImageRegistry.{extra[0]}: unknown field")
    user = _string(raw.get("username"), "fromImageRegistry.username")
    password = _string(raw.get("password"), "fromImageRegistry.password")
    return Credentials(user, password)


def _step(raw: object, index: int) -> Step:
    where = f"steps[{index}]"
    if not isinstance(raw, dict):
        raise SpecError(f"{where}: must be an object")
    extra = sorted(set(raw) - set(_STEP_FIELDS))
    if extra:
        raise SpecError(f"{where}.{extra[0]}: unknown field")
    kind = _string(raw.get("type"), f"{where}.type").upper()
    if kind not in STEP_TYPES:
        raise SpecError(f"{where}.type {kind!r}: not supported (use {', '.join(STEP_TYPES)})")
    args_raw = raw.get("args") or []
    if not isinstance(args_raw, list):
        raise SpecError(f"{where}.args: must be a list of strings")
    args = [_string(a, f"{where}.args") for a in args_raw]
    files_hash = raw.get("filesHash")
    if files_hash is not None:
        files_hash = _string(files_hash, f"{where}.filesHash")
    if kind == "COPY":
        if len(args) < 2 or not args[0] or not args[1]:
            raise SpecError(f"{where}: COPY needs args [src, dest, user?, mode?]")
        if not files_hash:
            raise SpecError(f"{where}.filesHash: COPY needs the hash of its uploaded files")
        if len(args) > 3 and args[3]:
            try:
                int(args[3], 8)
            except ValueError:
                raise SpecError(f"{where}.args[3]: mode {args[3]!r} is not octal") from None
    elif kind == "RUN":
        if not args or not args[0]:
            raise SpecError(f"{where}: RUN needs a command")
    elif kind in ("ENV", "ARG"):
        if len(args) % 2:
            raise SpecError(f"{where}: {kind} needs name/value pairs")
    elif not args or not args[0]:
        raise SpecError(f"{where}: {kind} needs one argument")
    for name in _CLIENT_STEP_FIELDS:
        if name != "forceUpload":
            _flag(raw.get(name), f"{where}.{name}")
    return Step(kind, args, files_hash, _flag(raw.get("force"), f"{where}.force"))


def parse(body: object) -> BuildSpec:
    if not isinstance(body, dict):
        raise SpecError("request body must be a JSON object")
    extra = sorted(set(body) - set(_BUILD_FIELDS))
    if extra:
        raise SpecError(f"{extra[0]}: unknown field")
    image = body.get("fromImage")
    template = body.get("fromTemplate")
    if image is not None:
        image = _string(image, "fromImage")
    if template is not None:
        template = _string(template, "fromTemplate")
    if bool(image) == bool(template):
        raise SpecError("exactly one of fromImage and fromTemplate is required")
    creds = None
    if body.get("fromImageRegistry") is not None:
        if not image:
            raise SpecError("fromImageRegistry: only with fromImage")
        creds = _registry(body["fromImageRegistry"])
    steps_raw = body.get("steps") or []
    if not isinstance(steps_raw, list):
        raise SpecError("steps: must be a list")
    start = body.get("startCmd")
    ready = body.get("readyCmd")
    return BuildSpec(
        from_image=image or None,
        from_template=template or None,
        credentials=creds,
        force=_flag(body.get("force"), "force"),
        steps=[_step(s, i) for i, s in enumerate(steps_raw)],
        start_cmd=_string(start, "startCmd") if start is not None else None,
        ready_cmd=_string(ready, "readyCmd") if ready is not None else None,
    )


def chain_key(parent: str, part: object) -> str:
    """The step cache's key: Docker's rule, the parent's key + what this step does."""
    text = json.dumps(part, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(f"{parent}\n{text}".encode()).hexdigest()
