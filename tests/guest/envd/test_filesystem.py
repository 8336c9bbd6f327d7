"""filesystem.Filesystem against a real envd subprocess, through the generated Connect client."""

# The tests inspect the real filesystem with blocking calls on purpose, beside envd.
# ruff: noqa: ASYNC230, ASYNC240

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from connectrpc.code import Code
from connectrpc.errors import ConnectError

from agentenv.guest.envd.gen.filesystem import filesystem_pb as pb
from agentenv.guest.envd.gen.filesystem.filesystem_connect import FilesystemClient

from .conftest import basic


async def test_stat_file_dir_symlink(fs_client: FilesystemClient, scratch: Path) -> None:
    f = scratch / "a.txt"
    f.write_text("hello")
    os.chmod(f, 0o640)
    (scratch / "link").symlink_to(f)
    entry = (await fs_client.stat(pb.StatRequest(path=str(f)))).entry
    assert entry is not None
    assert (entry.name, entry.path, entry.size) == ("a.txt", str(f), 5)
    assert entry.type == pb.FileType.FILE
    assert entry.mode == 0o640 and entry.permissions == "-rw-r-----"
    assert (entry.owner, entry.group) == ("root", "root")
    assert entry.modified_time is not None
    assert abs(entry.modified_time.seconds - int(f.stat().st_mtime)) <= 1

    d = (await fs_client.stat(pb.StatRequest(path=str(scratch)))).entry
    assert d is not None and d.type == pb.FileType.DIRECTORY and d.owner == "user"

    link = (await fs_client.stat(pb.StatRequest(path=str(scratch / "link")))).entry
    assert link is not None and link.is_symlink and link.symlink_target == str(f)


async def test_relative_paths_start_at_home(fs_client: FilesystemClient, scratch: Path) -> None:
    (scratch / "rel.txt").write_text("x")
    entry = (await fs_client.stat(pb.StatRequest(path=f"{scratch.name}/rel.txt"))).entry
    assert entry is not None and entry.path == str(scratch / "rel.txt")
    entry = (await fs_client.stat(pb.StatRequest(path=f"~/{scratch.name}/rel.txt"))).entry
    assert entry is not None and entry.path == str(scratch / "rel.txt")


async def test_stat_missing_is_not_found(fs_client: FilesystemClient, scratch: Path) -> None:
    with pytest.raises(ConnectError) as err:
        await fs_client.stat(pb.StatRequest(path=str(scratch / "missing")))
    assert err.value.code == Code.NOT_FOUND


async def test_make_dir_owner_and_already_exists(
    fs_client: FilesystemClient, scratch: Path
) -> None:
    target = scratch / "x" / "y" / "z"
    entry = (await fs_client.make_dir(pb.MakeDirRequest(path=str(target)))).entry
    assert entry is not None and entry.type == pb.FileType.DIRECTORY
    for directory in (scratch / "x", scratch / "x" / "y", target):
        assert directory.stat().st_uid == (scratch.stat().st_uid), "created dirs belong to the user"
    with pytest.raises(ConnectError) as err:
        await fs_client.make_dir(pb.MakeDirRequest(path=str(target)))
    assert err.value.code == Code.ALREADY_EXISTS


async def test_move_and_remove(fs_client: FilesystemClient, scratch: Path) -> None:
    (scratch / "a.txt").write_text("a")
    entry = (
        await fs_client.move(
            pb.MoveRequest(
                source=str(scratch / "a.txt"), destination=str(scratch / "sub" / "b.txt")
            )
        )
    ).entry
    assert entry is not None and entry.path == str(scratch / "sub" / "b.txt")
    assert (scratch / "sub" / "b.txt").read_text() == "a" and not (scratch / "a.txt").exists()
    await fs_client.remove(pb.RemoveRequest(path=str(scratch / "sub")))
    assert not (scratch / "sub").exists()
    # Upstream removes with os.RemoveAll: nothing there is nothing to do, not an error.
    await fs_client.remove(pb.RemoveRequest(path=str(scratch / "sub")))
    with pytest.raises(ConnectError) as err:
        await fs_client.move(
            pb.MoveRequest(source=str(scratch / "nope"), destination=str(scratch / "n2"))
        )
    assert err.value.code == Code.NOT_FOUND


async def test_list_dir_depth(fs_client: FilesystemClient, scratch: Path) -> None:
    (scratch / "d1" / "d2" / "d3").mkdir(parents=True)
    (scratch / "f.txt").write_text("f")
    (scratch / "d1" / "g.txt").write_text("g")
    one = (await fs_client.list_dir(pb.ListDirRequest(path=str(scratch), depth=1))).entries
    assert sorted(e.name for e in one) == ["d1", "f.txt"]
    two = (await fs_client.list_dir(pb.ListDirRequest(path=str(scratch), depth=2))).entries
    assert sorted(os.path.relpath(e.path, scratch) for e in two) == [
        "d1",
        "d1/d2",
        "d1/g.txt",
        "f.txt",
    ]
    default = (await fs_client.list_dir(pb.ListDirRequest(path=str(scratch)))).entries
    assert len(default) == 2
    with pytest.raises(ConnectError) as err:
        await fs_client.list_dir(pb.ListDirRequest(path=str(scratch / "f.txt")))
    assert err.value.code == Code.INVALID_ARGUMENT


async def test_user_acts_with_roots_rights_like_upstream(
    fs_client: FilesystemClient, scratch: Path
) -> None:
    """Upstream envd does every file operation as root: the user's mode bits refuse nothing."""
    private = scratch / "private"
    private.mkdir(mode=0o700)
    os.chown(private, 0, 0)
    (private / "secret.txt").write_text("s")
    user = basic("user")
    listed = (await fs_client.list_dir(pb.ListDirRequest(path=str(private)), headers=user)).entries
    assert [e.name for e in listed] == ["secret.txt"]
    entry = (
        await fs_client.make_dir(pb.MakeDirRequest(path=str(private / "x" / "y")), headers=user)
    ).entry
    assert entry is not None and entry.owner == "user"
    assert private.stat().st_uid == 0, "an existing directory keeps its owner"
    moved = (
        await fs_client.move(
            pb.MoveRequest(source=str(private / "secret.txt"), destination=str(private / "m.txt")),
            headers=user,
        )
    ).entry
    assert moved is not None and moved.owner == "root", "a move changes no owner"
    await fs_client.remove(pb.RemoveRequest(path=str(private / "m.txt")), headers=user)
    assert not (private / "m.txt").exists()


async def _collect_polled(
    fs_client: FilesystemClient, watcher_id: str, want: int
) -> list[pb.FilesystemEvent]:
    events: list[pb.FilesystemEvent] = []
    for _ in range(100):
        events += (
            await fs_client.get_watcher_events(pb.GetWatcherEventsRequest(watcher_id=watcher_id))
        ).events
        if len(events) >= want:
            break
        await asyncio.sleep(0.05)
    return events


async def test_polled_watcher_sees_create_write_remove_rename(
    fs_client: FilesystemClient, scratch: Path
) -> None:
    created = await fs_client.create_watcher(
        pb.CreateWatcherRequest(path=str(scratch), recursive=True, include_entry=True)
    )
    wid = created.watcher_id
    assert wid
    (scratch / "sub").mkdir()
    await asyncio.sleep(0.2)  # the new directory's watch is added when its event arrives
    with open(scratch / "sub" / "new.txt", "w") as f:
        f.write("data")
    os.rename(scratch / "sub" / "new.txt", scratch / "renamed.txt")
    os.unlink(scratch / "renamed.txt")
    events = await _collect_polled(fs_client, wid, 6)
    seen = [(e.name, e.type) for e in events]
    assert ("sub", pb.EventType.CREATE) in seen
    assert ("sub/new.txt", pb.EventType.CREATE) in seen
    assert ("sub/new.txt", pb.EventType.WRITE) in seen
    assert ("sub/new.txt", pb.EventType.RENAME) in seen
    assert ("renamed.txt", pb.EventType.CREATE) in seen
    assert ("renamed.txt", pb.EventType.REMOVE) in seen
    sub_event = next(e for e in events if e.name == "sub")
    assert sub_event.entry is not None and sub_event.entry.type == pb.FileType.DIRECTORY
    # Events are handed out once.
    assert (
        await fs_client.get_watcher_events(pb.GetWatcherEventsRequest(watcher_id=wid))
    ).events == []
    await fs_client.remove_watcher(pb.RemoveWatcherRequest(watcher_id=wid))
    with pytest.raises(ConnectError) as err:
        await fs_client.get_watcher_events(pb.GetWatcherEventsRequest(watcher_id=wid))
    assert err.value.code == Code.NOT_FOUND


async def test_non_recursive_watcher_ignores_subdirs(
    fs_client: FilesystemClient, scratch: Path
) -> None:
    (scratch / "sub").mkdir()
    wid = (await fs_client.create_watcher(pb.CreateWatcherRequest(path=str(scratch)))).watcher_id
    (scratch / "sub" / "deep.txt").write_text("x")
    (scratch / "top.txt").write_text("x")
    events = await _collect_polled(fs_client, wid, 2)
    names = {e.name for e in events}
    assert "top.txt" in names and "sub/deep.txt" not in names
    await fs_client.remove_watcher(pb.RemoveWatcherRequest(watcher_id=wid))


async def test_watch_missing_dir_is_not_found(fs_client: FilesystemClient, scratch: Path) -> None:
    with pytest.raises(ConnectError) as err:
        await fs_client.create_watcher(pb.CreateWatcherRequest(path=str(scratch / "missing")))
    assert err.value.code == Code.NOT_FOUND
    (scratch / "file").write_text("")
    with pytest.raises(ConnectError) as err:
        await fs_client.create_watcher(pb.CreateWatcherRequest(path=str(scratch / "file")))
    assert err.value.code == Code.INVALID_ARGUMENT


async def test_watch_dir_stream(fs_client: FilesystemClient, scratch: Path) -> None:
    stream: AsyncIterator[pb.WatchDirResponse] = fs_client.watch_dir(
        pb.WatchDirRequest(path=str(scratch), include_entry=True),
        headers={"Keepalive-Ping-Interval": "1"},
        timeout_ms=20_000,
    )
    first = await anext(stream)
    assert first.event is not None and first.event.field == "start"
    (scratch / "w.txt").write_text("hello")
    seen: list[tuple[str, pb.EventType]] = []
    keepalives = 0
    async for response in stream:
        assert response.event is not None
        if response.event.field == "keepalive":
            keepalives += 1
            if keepalives >= 1 and ("w.txt", pb.EventType.WRITE) in seen:
                break
            continue
        event = response.event.value
        assert isinstance(event, pb.FilesystemEvent)
        seen.append((event.name, event.type))
        if event.type == pb.EventType.CREATE:
            assert event.entry is not None and event.entry.name == "w.txt"
    await stream.aclose()  # type: ignore[attr-defined]
    assert ("w.txt", pb.EventType.CREATE) in seen
    assert ("w.txt", pb.EventType.WRITE) in seen
