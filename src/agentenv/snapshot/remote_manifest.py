"""The bucket's layout for snapshots: object keys (`snapshots/<id>.json`, `paused/<id>.json`),
the manifest format (`Manifest`, `RemoteLayer`, a paused sandbox's blob list) and the
errors of remote snapshots. Split from `remote.py`: what a push writes and a pull reads."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from agentenv.snapshot.errors import SnapshotError
from agentenv.snapshot.model import Snapshot

MANIFEST_PREFIX = "snapshots/"
PAUSED_PREFIX = "paused/"
# A blob nobody references is deleted only when neither it nor its mark changed for this
# long: longer than any push takes between uploading (or reusing) a blob and writing the
# manifest that names it.
GC_GRACE_S = 3600.0
# A push whose blob a collection deleted meanwhile is done again (it uploads what is missing).
PUSH_ATTEMPTS = 3
MANIFEST_VERSION = 1
PULL_LOCK_TIMEOUT_S = 3600.0


class RemoteSnapshotError(SnapshotError):
    """A snapshot could not be pushed to or pulled from object storage."""


class IncompletePush(RemoteSnapshotError):
    """A blob the push wrote its manifest for is not in the bucket (a collection took it)."""


def manifest_key(snapshot_id: str) -> str:
    return f"{MANIFEST_PREFIX}{snapshot_id}.json"


def paused_key(sandbox_id: str) -> str:
    return f"{PAUSED_PREFIX}{sandbox_id}.json"


def _paused_blobs(manifest: Any) -> set[str]:
    """The blobs a paused sandbox's manifest (`push_paused`'s) names."""
    if not isinstance(manifest, dict):
        return set()
    out = {str(layer["blob"]) for layer in manifest.get("layers", []) if "blob" in layer}
    out |= {str(f["blob"]) for f in dict(manifest.get("files", {})).values() if "blob" in f}
    return out


@dataclass(frozen=True)
class RemoteLayer:
    digest: str  # the layer's name in every store (and in the snapshot)
    blob: str  # sha256 of the file bytes that were uploaded
    size: int
    backing: str | None  # absolute backing path in the pushing node's store

    def to_dict(self) -> dict[str, Any]:
        return {
            "digest": self.digest,
            "blob": self.blob,
            "size": self.size,
            "backing": self.backing,
        }


@dataclass(frozen=True)
class Manifest:
    """What `snapshots/<id>.json` holds."""

    snapshot: Snapshot
    layers: list[RemoteLayer]
    memory: dict[str, Any] | None  # blob, size (packed), file_size, extents
    state: dict[str, Any] | None  # blob, size
    tools: dict[str, Any] | None  # path, blob, size

    def to_dict(self) -> dict[str, Any]:
        snap = self.snapshot.to_dict()
        # Local bookkeeping of the pushing node, not part of the snapshot.
        for local in ("holders", "deleted"):
            snap.pop(local, None)
        return {
            "version": MANIFEST_VERSION,
            "snapshot": snap,
            "layers": [layer.to_dict() for layer in self.layers],
            "memory": self.memory,
            "state": self.state,
            "tools": self.tools,
        }

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> Manifest:
        if raw.get("version") != MANIFEST_VERSION:
            raise RemoteSnapshotError(f"manifest version {raw.get('version')!r} is not supported")
        try:
            snap = Snapshot.from_dict({**raw["snapshot"], "holders": [], "deleted": False})
            layers = [RemoteLayer(**layer) for layer in raw["layers"]]
        except (KeyError, TypeError) as exc:
            raise RemoteSnapshotError(f"manifest is malformed: {exc}") from exc
        return cls(snap, layers, raw.get("memory"), raw.get("state"), raw.get("tools"))

    def blobs(self) -> set[str]:
        out = {layer.blob for layer in self.layers}
        for part in (self.memory, self.state):
            if part:
                out.add(part["blob"])
        if self.tools:
            out |= {entry["blob"] for entry in self.tools["files"].values()}
        return out
