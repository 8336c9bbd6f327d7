"""The `filesystem.Filesystem` Connect service."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import errno
import os
import shutil
import stat
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

from protobuf import Oneof

from . import paths
from .entries import entry_info, printable
from .errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
)
from .gen.filesystem import filesystem_pb as pb
from .gen.filesystem.filesystem_connect import Filesystem
from .inotify import DirWatcher, FsEvent
from .process_service import keepalive_interval
from .rpc import acting_user, streaming, unary
from .state import EnvdState
from .users import User

_EVENT_TYPES = {
    "create": pb.EventType.CREATE,
    "write": pb.EventType.WRITE,
    "remove": pb.EventType.REMOVE,
    "rename": pb.EventType.RENAME,
    "chmod": pb.EventType.CHMOD,
}
# Polling watchers keep this many undelivered events; older ones are dropped first.
MAX_PENDING_EVENTS = 10_000
MAX_WATCHERS = 256
STREAM_EVENT_QUEUE = 1024


def _to_event(watcher: DirWatcher, event: FsEvent, include_entry: bool) -> pb.FilesystemEvent:
    entry: pb.EntryInfo | None = None
    if include_entry and event.kind not in ("remove", "rename"):
        try:
            entry = entry_info(os.path.normpath(os.path.join(watcher.root, event.name)))
        except NotFound:
            entry = None
    name = printable(event.name)  # a name that is not UTF-8 must not poison the watcher
    return pb.FilesystemEvent(name=name, type=_EVENT_TYPES[event.kind], entry=entry)


class PolledWatcher:
    def __init__(self, watcher: DirWatcher, include_entry: bool) -> None:
        self.watcher = watcher
        self.include_entry = include_entry
        self.events: collections.deque[pb.FilesystemEvent] = collections.deque(
            maxlen=MAX_PENDING_EVENTS
        )


class FilesystemService(Filesystem):
    def __init__(self, state: EnvdState) -> None:
        self.state = state
        self.watchers: dict[str, PolledWatcher] = {}

    def _resolve(self, raw: str, user: User) -> str:
        return paths.resolve(raw, user, self.state.default_workdir)

    @unary
    async def stat(self, request: pb.StatRequest, ctx: Any) -> pb.StatResponse:
        user = acting_user(self.state, ctx)
        path = self._resolve(request.path, user)
        return pb.StatResponse(entry=await asyncio.to_thread(entry_info, path))

    @unary
    async def make_dir(self, request: pb.MakeDirRequest, ctx: Any) -> pb.MakeDirResponse:
        user = acting_user(self.state, ctx)
        path = self._resolve(request.path, user)
        return pb.MakeDirResponse(entry=await asyncio.to_thread(_make_dir, path, user))

    @unary
    async def move(self, request: pb.MoveRequest, ctx: Any) -> pb.MoveResponse:
        user = acting_user(self.state, ctx)
        source = self._resolve(request.source, user)
        destination = self._resolve(request.destination, user)
        entry = await asyncio.to_thread(_move, source, destination, user)
        return pb.MoveResponse(entry=entry)

    @unary
    async def list_dir(self, request: pb.ListDirRequest, ctx: Any) -> pb.ListDirResponse:
        user = acting_user(self.state, ctx)
        path = self._resolve(request.path, user)
        entries = await asyncio.to_thread(_list, path, request.depth or 1)
        return pb.ListDirResponse(entries=entries)

    @unary
    async def remove(self, request: pb.RemoveRequest, ctx: Any) -> pb.RemoveResponse:
        user = acting_user(self.state, ctx)
        path = self._resolve(request.path, user)
        await asyncio.to_thread(_remove, path)
        return pb.RemoveResponse()

    async def _watcher(
        self, raw: str, recursive: bool, allow_network: bool, user: User, sink: Any
    ) -> DirWatcher:
        path = self._resolve(raw, user)
        # A recursive watch walks the whole tree to place its watches: not on the event loop.
        return await asyncio.to_thread(
            DirWatcher, path, recursive=recursive, sink=sink, allow_network_mounts=allow_network
        )

    @streaming
    async def watch_dir(
        self, request: pb.WatchDirRequest, ctx: Any
    ) -> AsyncIterator[pb.WatchDirResponse]:
        user = acting_user(self.state, ctx)
        keepalive = keepalive_interval(ctx)
        queue: asyncio.Queue[FsEvent] = asyncio.Queue(STREAM_EVENT_QUEUE)

        def sink(event: FsEvent) -> None:
            # A client that does not keep up loses events rather than growing envd's memory,
            # as the kernel does with its own inotify queue.
            if not queue.full():
                queue.put_nowait(event)

        watcher = await self._watcher(
            request.path, request.recursive, request.allow_network_mounts, user, sink
        )
        watcher.start()
        try:
            start = pb.WatchDirResponse.StartEvent()
            yield pb.WatchDirResponse(
                event=Oneof[Literal["start"], pb.WatchDirResponse.StartEvent]("start", start)
            )
            while True:
                try:
                    event = await asyncio.wait_for(queue.get(), keepalive)
                except TimeoutError:
                    ping = pb.WatchDirResponse.KeepAlive()
                    yield pb.WatchDirResponse(
                        event=Oneof[Literal["keepalive"], pb.WatchDirResponse.KeepAlive](
                            "keepalive", ping
                        )
                    )
                    continue
                message = _to_event(watcher, event, request.include_entry)
                yield pb.WatchDirResponse(
                    event=Oneof[Literal["filesystem"], pb.FilesystemEvent]("filesystem", message)
                )
        finally:
            watcher.close()

    @unary
    async def create_watcher(
        self, request: pb.CreateWatcherRequest, ctx: Any
    ) -> pb.CreateWatcherResponse:
        user = acting_user(self.state, ctx)
        if len(self.watchers) >= MAX_WATCHERS:
            raise ResourceExhausted(
                f"too many watchers (at most {MAX_WATCHERS}); remove some first"
            )
        holder: list[PolledWatcher] = []

        def sink(event: FsEvent) -> None:
            polled = holder[0]
            polled.events.append(_to_event(polled.watcher, event, polled.include_entry))

        watcher = await self._watcher(
            request.path, request.recursive, request.allow_network_mounts, user, sink
        )
        polled = PolledWatcher(watcher, request.include_entry)
        holder.append(polled)
        watcher.start()
        watcher_id = uuid.uuid4().hex
        self.watchers[watcher_id] = polled
        return pb.CreateWatcherResponse(watcher_id=watcher_id)

    @unary
    async def get_watcher_events(
        self, request: pb.GetWatcherEventsRequest, ctx: Any
    ) -> pb.GetWatcherEventsResponse:
        acting_user(self.state, ctx)
        polled = self.watchers.get(request.watcher_id)
        if polled is None:
            raise NotFound(f"watcher {request.watcher_id!r} not found")
        events = list(polled.events)
        polled.events.clear()
        return pb.GetWatcherEventsResponse(events=events)

    @unary
    async def remove_watcher(
        self, request: pb.RemoveWatcherRequest, ctx: Any
    ) -> pb.RemoveWatcherResponse:
        acting_user(self.state, ctx)
        polled = self.watchers.pop(request.watcher_id, None)
        if polled is None:
            raise NotFound(f"watcher {request.watcher_id!r} not found")
        polled.watcher.close()
        return pb.RemoveWatcherResponse()

    def close(self) -> None:
        for polled in self.watchers.values():
            polled.watcher.close()
        self.watchers.clear()


def _list(path: str, depth: int) -> list[pb.EntryInfo]:
    """ListDir: `path` (through symlinks) must be a directory; entries keep `path` as prefix."""
    try:
        st = os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        raise NotFound(f"path not found: {path}") from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise FailedPrecondition(f"cyclic symlink or too long a chain at {path}") from None
        raise
    if not stat.S_ISDIR(st.st_mode):
        raise InvalidArgument(f"path is not a directory: {path}")
    return _walk(path, depth)


def _walk(root: str, depth: int) -> list[pb.EntryInfo]:
    """Entries under `root` down to `depth` levels, sorted by name, each directory's children
    right after it (upstream's filepath.WalkDir order). Symlinked directories are listed but
    not entered; entries that vanish meanwhile are skipped."""
    entries: list[pb.EntryInfo] = []

    def visit(directory: str, level: int) -> None:
        try:
            with os.scandir(directory) as it:
                children = sorted(it, key=lambda e: e.name)
        except (FileNotFoundError, NotADirectoryError):
            return
        for child in children:
            try:
                st = child.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            entries.append(entry_info(child.path, st))
            if level < depth and stat.S_ISDIR(st.st_mode):
                visit(child.path, level + 1)

    visit(root, 1)
    return entries


def _make_dir(path: str, user: User) -> pb.EntryInfo:
    if os.path.lexists(path):
        if os.path.isdir(path):
            raise AlreadyExists(f"directory already exists: {path}")
        raise InvalidArgument(f"path already exists and is not a directory: {path}")
    paths.makedirs_as(path, user)
    return entry_info(path)


def _move(source: str, destination: str, user: User) -> pb.EntryInfo:
    if not os.path.lexists(source):
        raise NotFound(f"path not found: {source}")
    paths.makedirs_as(os.path.dirname(destination), user)
    try:
        os.rename(source, destination)
    except OSError as exc:
        if exc.errno == errno.EXDEV:
            shutil.move(source, destination)
        elif exc.errno in (errno.EISDIR, errno.ENOTDIR, errno.EEXIST, errno.ENOTEMPTY):
            raise InvalidArgument(
                f"cannot move {source} to {destination}: {exc.strerror}"
            ) from None
        else:
            raise
    return entry_info(destination)


def _remove(path: str) -> None:
    """Upstream envd's Remove is `os.RemoveAll`: a path that is not there is already removed,
    and a symlink is removed itself, never what it points to."""
    if not os.path.lexists(path):
        return
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, onerror=_unless_vanished)
        return
    with contextlib.suppress(FileNotFoundError):  # removed meanwhile
        os.unlink(path)


def _unless_vanished(function: Any, path: str, exc_info: Any) -> None:
    # Something that another process removed meanwhile needs no removing; anything else fails.
    if not isinstance(exc_info[1], FileNotFoundError):
        raise exc_info[1]
