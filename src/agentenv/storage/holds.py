"""Who holds what: one empty file per hold, `<root>/<target>/<holder>`.

Layers and snapshots are kept while anything holds them (a sandbox, a template, a snapshot
over a layer). A hold was a line in one JSON table per store, rewritten whole on every take
and drop: its cost grew with the number of live sandboxes (a kill's drop ~1 ms at 20
sandboxes, ~4 at 1000, for the snapshot table with its fsync). A file per hold makes a take
one `open(O_CREAT)` and a drop one `unlink`, whatever else is held; both are atomic, so a
crash leaves each hold either there or not.

Not fsynced, as the tables were not (the layer table) or need not be: after a power loss
the sandboxes whose holds could be lost are gone too; what must outlive one (a template's
name, a snapshot's layers) is also recorded in a catalog that is.

The callers serialise a take against the removal of what it takes (each store's own lock);
this module only keeps the files.
"""

from __future__ import annotations

import contextlib
import errno
import os
from pathlib import Path
from urllib.parse import quote, unquote


def _file_name(holder: str) -> str:
    # Holders are ids with a prefix ("snapshot:<id>", "reset:<id>"): escaped so that none
    # can name a path ("/", "." or "..") or start with a dot.
    name = quote(holder, safe=":-_@+=")
    return "%2E" + name[1:] if name.startswith(".") else name


def _holder(file_name: str) -> str:
    return unquote(file_name) if "%" in file_name else file_name


# The directory a store keeps its holds in, under its root.
HOLDS_DIR = ".holds"


class Holds:
    """The holds under `root`, one directory per held target."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def _dir(self, target: str) -> str:
        return os.path.join(self.root, _file_name(target))

    def add(self, target: str, holder: str) -> None:
        path = os.path.join(self._dir(target), _file_name(holder))
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except FileNotFoundError:
            os.makedirs(self._dir(target), exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o644)
        os.close(fd)

    def drop(self, target: str, holder: str) -> bool:
        """Whether there was such a hold."""
        try:
            os.unlink(os.path.join(self._dir(target), _file_name(holder)))
        except FileNotFoundError:
            return False
        return True

    def holders(self, target: str) -> list[str]:
        try:
            return sorted(_holder(n) for n in os.listdir(self._dir(target)))
        except FileNotFoundError:
            return []

    def held(self, target: str) -> bool:
        # An empty directory is removed on the way: the kernel stops at the first entry it
        # finds, where a listing reads a whole block of a directory with many holders.
        try:
            os.rmdir(self._dir(target))
        except FileNotFoundError:
            return False
        except OSError as exc:
            if exc.errno in (errno.ENOTEMPTY, errno.EEXIST):
                return True
            raise
        return False

    def targets(self) -> list[str]:
        """Targets with at least one hold."""
        return [t for t in self._target_names() if self.held(t)]

    def _target_names(self) -> list[str]:
        try:
            return sorted(_holder(n) for n in os.listdir(self.root))
        except FileNotFoundError:
            return []

    def held_by(self, holder: str) -> list[str]:
        name = _file_name(holder)
        return [
            t for t in self._target_names() if os.path.lexists(os.path.join(self._dir(t), name))
        ]

    def release(self, holder: str) -> list[str]:
        """Drop every hold of `holder`; the targets it held (a stat or unlink per target,
        not per hold)."""
        return [t for t in self._target_names() if self.drop(t, holder)]

    def all_holders(self) -> set[str]:
        out: set[str] = set()
        for target in self._target_names():
            out.update(self.holders(target))
        return out

    def forget(self, target: str) -> None:
        """Remove a target's directory once the target itself is gone (its holds with it)."""
        path = self._dir(target)
        with contextlib.suppress(FileNotFoundError):
            for name in os.listdir(path):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(path, name))
            os.rmdir(path)
