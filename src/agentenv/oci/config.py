"""The image configuration blob: what a container of the image runs by default.

The fields the template code uses (Env, WorkingDir, User, Entrypoint, Cmd, ExposedPorts)
become typed attributes; `diff_ids` (the uncompressed layer digests, bottom first) check the
layers and name the block layers. Absent fields get Docker's defaults (working dir ``/``,
user root), so callers never see None for them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from agentenv.oci.errors import InvalidReference, RegistryError
from agentenv.oci.manifest import Platform
from agentenv.oci.reference import check_digest


@dataclass(frozen=True)
class ImageConfig:
    platform: Platform
    env: tuple[tuple[str, str], ...] = ()
    working_dir: str = "/"
    user: str = ""
    entrypoint: tuple[str, ...] = ()
    cmd: tuple[str, ...] = ()
    exposed_ports: tuple[tuple[int, str], ...] = ()
    labels: dict[str, str] = field(default_factory=dict, compare=False)
    stop_signal: str | None = None
    diff_ids: tuple[str, ...] = ()

    @property
    def env_dict(self) -> dict[str, str]:
        return dict(self.env)

    @property
    def command(self) -> tuple[str, ...]:
        """Entrypoint followed by Cmd: the argv a plain `docker run IMAGE` executes."""
        return self.entrypoint + self.cmd

    @property
    def user_name(self) -> str:
        """The user part of ``user[:group]`` (``root`` when unset)."""
        return self.user.split(":", 1)[0] or "root"


def _strings(raw: Any, what: str) -> tuple[str, ...]:
    if raw is None:
        return ()
    if isinstance(raw, str):
        # Docker stores a shell-form command already as a list; a bare string is one arg.
        return (raw,)
    if not isinstance(raw, list) or not all(isinstance(x, str) for x in raw):
        raise RegistryError(f"image config: {what} is not a list of strings")
    return tuple(raw)


def _ports(raw: Any) -> tuple[tuple[int, str], ...]:
    if not raw:
        return ()
    if not isinstance(raw, dict):
        raise RegistryError("image config: ExposedPorts is not an object")
    out = []
    for key in raw:
        number, _, proto = str(key).partition("/")
        try:
            port = int(number)
        except ValueError:
            raise RegistryError(f"image config: exposed port {key!r} is not a number") from None
        if not 0 < port < 65536:
            raise RegistryError(f"image config: exposed port {key!r} is out of range")
        out.append((port, proto or "tcp"))
    return tuple(sorted(out))


def parse_config(body: bytes) -> ImageConfig:
    try:
        doc = json.loads(body)
    except ValueError as exc:
        raise RegistryError(f"image config is not JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise RegistryError("image config is not a JSON object")
    cfg = doc.get("config") or {}
    if not isinstance(cfg, dict):
        raise RegistryError("image config: config is not an object")
    env = []
    for item in _strings(cfg.get("Env"), "Env"):
        name, _, value = item.partition("=")
        env.append((name, value))
    rootfs = doc.get("rootfs") or {}
    try:
        diff_ids = tuple(check_digest(str(d)) for d in rootfs.get("diff_ids") or [])
    except InvalidReference as exc:
        raise RegistryError(f"image config: bad diff_id ({exc})") from None
    labels = cfg.get("Labels") or {}
    return ImageConfig(
        platform=Platform(
            str(doc.get("os", "")), str(doc.get("architecture", "")), doc.get("variant")
        ),
        env=tuple(env),
        working_dir=str(cfg.get("WorkingDir") or "/"),
        user=str(cfg.get("User") or ""),
        entrypoint=_strings(cfg.get("Entrypoint"), "Entrypoint"),
        cmd=_strings(cfg.get("Cmd"), "Cmd"),
        exposed_ports=_ports(cfg.get("ExposedPorts")),
        labels={str(k): str(v) for k, v in labels.items()} if isinstance(labels, dict) else {},
        stop_signal=cfg.get("StopSignal"),
        diff_ids=diff_ids,
    )
