"""What the catalog records about one snapshot."""

from __future__ import annotations

import time
from dataclasses import dataclass, field, fields
from typing import Any


@dataclass
class Snapshot:
    """An immutable capture of a guest: RAM image, device state and disk layers.

    `layers` are layer-store digests bottom → top; a restored guest gets a fresh upper over
    the top one. `tools_image` is the read-only tools disk the guest had mounted: its page
    cache is part of the RAM image, so a restore must attach the very same file (a
    filesystem-only snapshot has no RAM image: its creates boot with the current one).
    """

    id: str
    layers: list[str]
    vcpus: int
    memory_mb: int
    balloon: bool
    tools_image: str
    accel: str
    qemu_version: str
    envd_version: str
    # Bytes the memory file holds on disk (holes of never-touched RAM are not counted).
    memory_bytes: int
    state_bytes: int
    names: list[str] = field(default_factory=list)
    parent: str | None = None
    # What it was captured from: "template:<name>" or a sandbox id.
    source: str = ""
    # Hash of the inputs a template snapshot was built from ("" for captures of sandboxes).
    build_key: str = ""
    created_at: float = field(default_factory=time.time)
    # Sandboxes whose RAM is a private mapping of this snapshot's memory file.
    holders: list[str] = field(default_factory=list)
    # envd's access token inside the captured guest: a restore needs it for its first `/init`.
    envd_token: str | None = None
    # Deleted while sandboxes still mapped it: invisible, removed when the last one is gone.
    deleted: bool = False
    # `vmm.qemu_argv.DEVICE_SET` of the guest that was captured ("1": before the field existed).
    device_set: str = "1"
    # False: a filesystem-only snapshot (E2B's `memory: false`): layers only, no RAM image or
    # device state; a create from it cold-boots over a fresh upper on its top layer.
    memory: bool = True

    @property
    def top_layer(self) -> str:
        return self.layers[-1]

    def to_dict(self) -> dict[str, Any]:
        # Every field is a scalar or a list of strings: a copy one level deep is `asdict`'s
        # result without its recursive deep copy, which was most of a catalog access's CPU.
        return {k: list(v) if isinstance(v, list) else v for k, v in vars(self).items()}

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> Snapshot:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in raw.items() if k in known})
