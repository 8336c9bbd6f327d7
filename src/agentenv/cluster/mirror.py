"""A replica's copy of one etcd directory, kept by a watch: reads of small directories that a
create or a REST request would otherwise make of etcd every time (#23).

Placement listed the live nodes, their cordons, the catalog's holders of the template and the
nodes holding it warm (five prefix reads per create), and the API key check read its key per
REST request. Each was a read through etcd's leader. A `PrefixMirror` lists its directory once
at revision R, follows it with a watch from R+1, and answers from memory while that watch
streams; a change made anywhere arrives a few milliseconds later. While it is not in step
(not started yet, a broken watch being opened again, a compacted revision being listed again)
`under` and `get` say "not known" (None) and the caller reads etcd as before, so a mirror
never answers from a copy it knows to be behind.

What it is for: reads whose answer may be milliseconds old. Placement's view of the nodes is
as old as their last heartbeat anyway, and a node that left is refused at its RPC; a key
revoked elsewhere stops working at this replica when the watch delivers the revocation. An
entry that exists but has not arrived yet must cost nothing wrong, so the readers take an
empty answer as "read etcd" where an absence decides something (a node that published a
template or a snapshot's copy a moment ago is where a create must go; a key made a moment
ago at another replica must work). Not for compare-and-set starts. This replica's own writes
are read back at once through `forget`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from agentenv.cluster.etcd import Etcd, KeyValue, PrefixWatch, WatchEvent

log = logging.getLogger(__name__)

# After a broken watch (etcd unreachable past its deadline, a compacted revision): the pause
# before listing the directory again.
RESYNC_PAUSE_S = 1.0


class PrefixFollower:
    """The loop every watched copy of a directory runs: list `prefix` at revision R, watch it
    from R+1, and after a broken watch (etcd unreachable past its deadline, a compacted
    revision) list it again after `RESYNC_PAUSE_S`. What the listing and the events mean is
    the subclass's (`_listed`, `_changed`): a `PrefixMirror` here, the sandbox rows'
    `control.etcd_rows.RowView`."""

    def __init__(self, etcd: Etcd, prefix: bytes, name: str) -> None:
        self._etcd = etcd
        self.prefix = prefix
        self.name = name
        self._in_step = False
        self._watch: PrefixWatch | None = None
        self._task: asyncio.Task[None] | None = None

    @property
    def in_step(self) -> bool:
        # Listed, and the watch's stream open: not while a broken one is opened again.
        return self._in_step and self._watch is not None and self._watch.streaming

    def _listed(self, kvs: list[KeyValue], revision: int) -> None:
        raise NotImplementedError

    def _changed(self, event: WatchEvent) -> None:
        raise NotImplementedError

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._follow(), name=f"etcd {self.name}")

    async def stop(self) -> None:
        task, self._task = self._task, None
        self._in_step = False
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _follow(self) -> None:
        while True:
            watch = None
            try:
                kvs, revision = await self._etcd.get_prefix(self.prefix)
                self._listed(kvs, revision)
                watch = self._watch = self._etcd.watch_prefix(self.prefix, revision + 1)
                self._in_step = True
                async for event in watch:
                    self._changed(event)
                raise RuntimeError("the watch ended")
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a lost etcd, a compacted revision (`WatchCompacted`)
                log.info("%s: watch out of step (%s); listing again", self.name, exc)
            finally:
                self._in_step, self._watch = False, None
                if watch is not None:
                    with contextlib.suppress(Exception):
                        await watch.stop()
            await asyncio.sleep(RESYNC_PAUSE_S)


class PrefixMirror(PrefixFollower):
    """Every key under `prefix` (a directory: it ends with "/"), as the watch last told."""

    def __init__(self, etcd: Etcd, prefix: bytes, name: str) -> None:
        super().__init__(etcd, prefix, f"mirror of {name}")
        self._kvs: dict[bytes, KeyValue] = {}
        # Keys this replica wrote whose new value the watch has not delivered yet (`forget`).
        self._stale: set[bytes] = set()

    def under(self, prefix: bytes) -> list[KeyValue] | None:
        """The keys under `prefix` (within this mirror's directory), sorted by key; None
        when the mirror is not in step (read etcd)."""
        if not prefix.startswith(self.prefix):
            raise ValueError(f"{prefix!r} is not under the mirrored {self.prefix!r}")
        if not self.in_step or any(k.startswith(prefix) for k in self._stale):
            return None
        return sorted((kv for k, kv in self._kvs.items() if k.startswith(prefix)), key=_key)

    def get(self, key: bytes) -> tuple[bool, KeyValue | None]:
        """(known, the key's value or None when it does not exist); not known while the
        mirror is not in step."""
        if not self.in_step or key in self._stale:
            return False, None
        return True, self._kvs.get(key)

    def forget(self, key: bytes) -> None:
        """`key` is not known here until the watch delivers its next change: a write this
        replica just made must not be answered from the copy from before it."""
        self._stale.add(key)

    def _listed(self, kvs: list[KeyValue], revision: int) -> None:
        # `_stale` stays: a listing may have been read before this replica's write.
        self._kvs = {kv.key: kv for kv in kvs}

    def _changed(self, event: WatchEvent) -> None:
        self._stale.discard(event.kv.key)
        if event.kind == "put":
            self._kvs[event.kv.key] = event.kv
        else:
            self._kvs.pop(event.kv.key, None)


def _key(kv: KeyValue) -> bytes:
    return kv.key
