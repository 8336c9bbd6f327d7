"""The image cache: downloaded blobs and chain block layers, with a size cap and pins.

Layout under ``<data dir>/oci/``::

    blobs/sha256/<hex>            a complete blob whose digest and size were checked (0444)
    blobs/sha256/<hex>.partial    a download under way or cut short: the next one resumes it
    locks/<hex>.lock              held while one process downloads or builds that item
    chains/<hex>.json             chain id -> the block layer (see `agentenv.oci.blocks`)
    images/<hex>.json             a pulled image: reference, manifest, config, layers, chains
    index.json                    every entry's kind, size and last use, and the pins

**Pins** are how the rest of agentenv says "in use": `pin(holder, keys)` records that
`holder` (``template:<name>``, ``snapshot:<id>``, a sandbox id, or a pull under way,
``pull:<pid>:<n>``) needs those entries; `unpin(holder)` drops all of that holder's pins.
`pin_image(holder, image)` pins everything an image consists of (manifest, config, layer
blobs, chain block layers). `collect(cap_bytes)` then removes least recently used entries
until the cache is under the cap, never one that is pinned, and never a chain block layer
that the layer store still references for anyone else (templates, snapshots and sandboxes
hold their disk layers there) or that backs another layer. Pins of a pull whose process is
gone are dropped by `collect`. Entry keys are ``blob:<digest>`` and ``chain:<chain id>``.

The index is a JSON file rewritten under an flock; every critical section is short and
synchronous (callers run them in a thread), like the layer store's refs.
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import json
import os
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentenv.config import Settings
from agentenv.oci.errors import CacheError
from agentenv.oci.reference import check_digest
from agentenv.storage.errors import LayerInUse, StorageError
from agentenv.storage.layers import LayerStore

CHAIN_HOLDER = "oci-chain:"
PULL_HOLDER = "pull:"
_pull_ids = itertools.count()


def oci_dir(settings: Settings) -> Path:
    return settings.home / "oci"


@dataclass(frozen=True)
class Entry:
    key: str
    kind: str  # "blob" or "chain"
    size: int
    last_used: float


def _hex(digest: str) -> str:
    return check_digest(digest).split(":", 1)[1]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class ImageCache:
    def __init__(self, root: Path, layers: LayerStore) -> None:
        self.root = root
        self.layers = layers
        self.blobs = root / "blobs" / "sha256"
        self.locks = root / "locks"
        self.chains = root / "chains"
        self.images = root / "images"

    @classmethod
    def for_settings(cls, settings: Settings) -> ImageCache:
        return cls(oci_dir(settings), LayerStore(settings.layers_dir))

    def ensure_dirs(self) -> None:
        for d in (self.blobs, self.locks, self.chains, self.images):
            d.mkdir(parents=True, exist_ok=True)

    # -- paths ----------------------------------------------------------------------------------

    def blob_path(self, digest: str) -> Path:
        return self.blobs / _hex(digest)

    def partial_path(self, digest: str) -> Path:
        return self.blobs / f"{_hex(digest)}.partial"

    def lock_path(self, digest: str) -> Path:
        return self.locks / f"{_hex(digest)}.lock"

    def chain_record(self, chain_id: str) -> Path:
        return self.chains / f"{_hex(chain_id)}.json"

    def image_record(self, manifest_digest: str) -> Path:
        return self.images / f"{_hex(manifest_digest)}.json"

    def has_blob(self, digest: str) -> bool:
        return self.blob_path(digest).is_file()

    # -- the index ------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _locked(self) -> Iterator[dict[str, Any]]:
        self.ensure_dirs()
        with (self.root / ".lock").open("a+") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            path = self.root / "index.json"
            doc: dict[str, Any] = {"entries": {}, "pins": {}}
            if path.exists():
                doc = json.loads(path.read_text() or "{}") or doc
                doc.setdefault("entries", {})
                doc.setdefault("pins", {})
            before = json.dumps(doc, sort_keys=True)
            yield doc
            doc["pins"] = {k: sorted(set(v)) for k, v in doc["pins"].items() if v}
            after = json.dumps(doc, sort_keys=True)
            if after != before:
                tmp = path.with_suffix(".tmp")
                try:
                    tmp.write_text(after)
                    os.replace(tmp, path)
                except OSError:
                    tmp.unlink(missing_ok=True)  # a full disk: keep the old index whole
                    raise

    def record(self, key: str, kind: str, size: int) -> None:
        """Add or refresh an entry (used when a blob lands or a chain layer is built)."""
        with self._locked() as doc:
            doc["entries"][key] = {"kind": kind, "size": size, "last_used": time.time()}

    def touch(self, keys: Iterable[str]) -> None:
        now = time.time()
        with self._locked() as doc:
            for key in keys:
                if key in doc["entries"]:
                    doc["entries"][key]["last_used"] = now

    def entries(self) -> list[Entry]:
        with self._locked() as doc:
            return [
                Entry(k, v["kind"], int(v["size"]), float(v["last_used"]))
                for k, v in doc["entries"].items()
            ]

    def total_bytes(self) -> int:
        return sum(e.size for e in self.entries())

    # -- pins -----------------------------------------------------------------------------------

    def pin(self, holder: str, keys: Iterable[str]) -> None:
        with self._locked() as doc:
            for key in keys:
                held = doc["pins"].setdefault(key, [])
                if holder not in held:
                    held.append(holder)

    def unpin(self, holder: str) -> None:
        with self._locked() as doc:
            for held in doc["pins"].values():
                if holder in held:
                    held.remove(holder)

    def pins(self, key: str) -> list[str]:
        with self._locked() as doc:
            return list(doc["pins"].get(key, []))

    def pin_image(self, holder: str, manifest_digest: str) -> None:
        """Pin every entry the pulled image `manifest_digest` is made of."""
        self.pin(holder, self.image_keys(manifest_digest))

    def image_keys(self, manifest_digest: str) -> list[str]:
        path = self.image_record(manifest_digest)
        if not path.is_file():
            raise CacheError(f"image {manifest_digest} is not in the cache")
        rec = json.loads(path.read_text())
        keys = [f"blob:{d}" for d in [rec["manifest"], rec["config"], *rec["layers"]]]
        if rec.get("index"):
            keys.append(f"blob:{rec['index']}")
        keys += [f"chain:{c}" for c in rec.get("chains", [])]
        return keys

    @staticmethod
    def new_pull_holder() -> str:
        return f"{PULL_HOLDER}{os.getpid()}:{next(_pull_ids)}"

    # -- collection -----------------------------------------------------------------------------

    def collect(self, cap_bytes: int) -> list[str]:
        """Remove least recently used, unpinned entries until the cache fits `cap_bytes`;
        return the removed keys."""
        removed: list[str] = []
        with self._locked() as doc:
            for held in doc["pins"].values():
                held[:] = [h for h in held if not self._dead_pull(h)]
            entries: dict[str, dict[str, Any]] = doc["entries"]
            pinned = {k for k, v in doc["pins"].items() if v}
            total = sum(int(v["size"]) for v in entries.values())
            # Several passes: a chain layer can only go once the layers above it have gone.
            progress = True
            while total > cap_bytes and progress:
                progress = False
                for key in sorted(entries, key=lambda k: float(entries[k]["last_used"])):
                    if total <= cap_bytes:
                        break
                    if key in pinned or not self._remove(key):
                        continue
                    total -= int(entries.pop(key)["size"])
                    removed.append(key)
                    progress = True
        return removed

    @staticmethod
    def _dead_pull(holder: str) -> bool:
        if not holder.startswith(PULL_HOLDER):
            return False
        pid = holder[len(PULL_HOLDER) :].split(":", 1)[0]
        return pid.isdigit() and not _pid_alive(int(pid))

    def _remove(self, key: str) -> bool:
        kind, _, digest = key.partition(":")
        if kind == "blob":
            self.blob_path(digest).unlink(missing_ok=True)
            return True
        if kind == "chain":
            return self._remove_chain(digest)
        return True

    def _remove_chain(self, chain_id: str) -> bool:
        path = self.chain_record(chain_id)
        if not path.is_file():
            return True
        layer = str(json.loads(path.read_text())["layer"])
        holder = CHAIN_HOLDER + chain_id
        others = [h for h in self.layers.holders(layer) if h != holder]
        if others:
            return False
        self.layers.unref(layer, holder)
        try:
            self.layers.remove(layer)
        except LayerInUse:
            self.layers.ref(layer, holder)
            return False
        except StorageError:
            pass  # already gone from the store: only the record is left
        path.unlink(missing_ok=True)
        return True
