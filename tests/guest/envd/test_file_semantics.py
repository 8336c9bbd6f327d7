"""envd's file operations behave as upstream envd's (docs/envd-files.md has the table).

One test per row fixed for issue 21: operations run as root whatever the user (the user owns
what is created), non-ASCII names everywhere, symlinks described as upstream does, Go's mode
strings, and how a multipart upload picks its destinations. Through the official SDK where a
user would see the difference, through raw Connect/HTTP where the wire fields matter.
"""

# The tests set up and inspect the real filesystem with blocking calls on purpose, beside envd.
# ruff: noqa: ASYNC240

from __future__ import annotations

import asyncio
import os
import pwd
import shutil
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from e2b import FilesystemEventType, Sandbox
from e2b.sandbox.filesystem.filesystem import FileType

from agentenv.guest.envd.gen.filesystem import filesystem_pb as pb
from agentenv.guest.envd.gen.filesystem.filesystem_connect import FilesystemClient

from .conftest import EnvdProc, basic


@pytest.fixture
def sbx(envd: EnvdProc, monkeypatch: pytest.MonkeyPatch) -> Sandbox:
    # As in test_sdk.py: E2B_DEBUG skips the control plane, E2B_SANDBOX_URL points at envd.
    monkeypatch.setenv("E2B_DEBUG", "true")
    monkeypatch.setenv("E2B_SANDBOX_URL", envd.url)
    monkeypatch.setenv("E2B_API_KEY", "unused-in-debug-mode")
    return Sandbox.create()


@pytest.fixture
def uid(sandbox_user: str) -> int:
    return pwd.getpwnam(sandbox_user).pw_uid


@pytest.fixture
def top_level() -> Iterator[Path]:
    """A path straight under `/` (root's 0755), as `/workspace` is; removed afterwards."""
    path = Path(f"/envd-top-{os.getpid()}-{time.monotonic_ns()}")
    yield path
    shutil.rmtree(path, ignore_errors=True)


# Who performs each operation, and who owns what it creates ---------------------------------


def test_make_dir_under_root_owned_dir_as_default_user(
    sbx: Sandbox, top_level: Path, uid: int
) -> None:
    assert sbx.files.make_dir(str(top_level)) is True
    assert top_level.stat().st_uid == uid
    assert sbx.files.make_dir(f"{top_level}/a/b") is True
    for path in (top_level / "a", top_level / "a" / "b"):
        assert path.stat().st_uid == uid, path
    assert sbx.files.make_dir(str(top_level)) is False
    info = sbx.files.get_info(str(top_level))
    assert (info.type, info.owner) == (FileType.DIR, "user")


def test_write_under_root_owned_dir_as_default_user(
    sbx: Sandbox, top_level: Path, uid: int
) -> None:
    info = sbx.files.write(f"{top_level}/sub/f.txt", "content")
    assert info.path == f"{top_level}/sub/f.txt"
    for path in (top_level, top_level / "sub", top_level / "sub" / "f.txt"):
        assert path.stat().st_uid == uid, path
    # A file of root's, overwritten by the user, becomes the user's (upstream chowns it too).
    theirs = top_level / "root.txt"
    theirs.write_text("root")
    os.chmod(theirs, 0o600)
    sbx.files.write(str(theirs), "mine")
    assert theirs.read_text() == "mine"
    assert (theirs.stat().st_uid, theirs.stat().st_mode & 0o777) == (uid, 0o600)


async def test_reads_need_no_rights_of_the_user(
    http: httpx.AsyncClient, fs_client: FilesystemClient, scratch: Path
) -> None:
    private = scratch / "private"
    private.mkdir(mode=0o700)
    os.chown(private, 0, 0)
    secret = private / "secret.txt"
    secret.write_text("s")
    os.chmod(secret, 0o600)
    read = await http.get("/files", params={"path": str(secret), "username": "user"})
    assert (read.status_code, read.content) == (200, b"s")
    entry = (await fs_client.stat(pb.StatRequest(path=str(secret)), headers=basic("user"))).entry
    assert entry is not None and entry.owner == "root"


# Non-ASCII names --------------------------------------------------------------------------


def test_non_ascii_names_through_the_sdk(sbx: Sandbox, scratch: Path) -> None:
    # The report in issue 21: this raised 400 "'latin-1' codec can't encode characters".
    target = f"{scratch}/u/测试文件.txt"
    info = sbx.files.write(target, "content")
    assert (info.name, info.path) == ("测试文件.txt", target)
    assert sbx.files.read(target) == "content"
    assert (scratch / "u" / "测试文件.txt").read_text() == "content"
    assert sbx.files.get_info(target).name == "测试文件.txt"
    assert sbx.files.exists(target)
    sbx.files.write_files(
        [
            {"path": f"{scratch}/u/ünïcödé.txt", "data": "one"},
            {"path": f"{scratch}/u/日本語 名前.bin", "data": b"\x00"},
        ]
    )
    names = {entry.name for entry in sbx.files.list(f"{scratch}/u")}
    assert names == {"日本語 名前.bin", "测试文件.txt", "ünïcödé.txt"}
    renamed = sbx.files.rename(target, f"{scratch}/u/名前.txt")
    assert renamed.name == "名前.txt"
    sbx.files.remove(f"{scratch}/u/名前.txt")
    assert not sbx.files.exists(f"{scratch}/u/名前.txt")


def test_non_ascii_watch_events(sbx: Sandbox, scratch: Path) -> None:
    watcher = sbx.files.watch_dir(str(scratch))
    sbx.files.write(f"{scratch}/événement.txt", "x")
    events = []
    for _ in range(40):
        events += watcher.get_new_events()
        if any(e.type == FilesystemEventType.WRITE for e in events):
            break
        time.sleep(0.05)
    watcher.stop()
    assert ("événement.txt", FilesystemEventType.CREATE) in {(e.name, e.type) for e in events}


def _multipart(boundary: str, *parts: tuple[bytes, bytes]) -> bytes:
    body = b""
    for disposition, content in parts:
        body += f"--{boundary}\r\n".encode() + b"Content-Disposition: " + disposition
        body += b"\r\nContent-Type: application/octet-stream\r\n\r\n" + content + b"\r\n"
    return body + f"--{boundary}--\r\n".encode()


async def test_multipart_filename_forms(http: httpx.AsyncClient, scratch: Path) -> None:
    extended = str(scratch / "ünï 文件.txt")
    body = _multipart(
        "b0undary",
        # Another form field is not a file: skipped, as upstream does.
        (b'form-data; name="note"', b"not a file"),
        # RFC 5987, and it wins over the plain fallback name.
        (
            b'form-data; name="file"; filename="fallback.txt"; filename*=UTF-8\'\''
            + urllib.parse.quote(extended).encode(),
            b"extended",
        ),
        # Bytes that are not UTF-8 name the file byte for byte.
        (b'form-data; name="file"; filename="' + bytes(scratch) + b'/caf\xe9.txt"', b"latin"),
    )
    response = await http.post(
        "/files",
        content=body,
        headers={"content-type": "multipart/form-data; boundary=b0undary"},
    )
    assert response.status_code == 200, response.text
    assert [entry["name"] for entry in response.json()] == ["ünï 文件.txt", "caf\ufffd.txt"]
    assert Path(extended).read_bytes() == b"extended"
    assert not (scratch / "fallback.txt").exists() and not (scratch / "note").exists()
    assert Path(os.fsdecode(bytes(scratch) + b"/caf\xe9.txt")).read_bytes() == b"latin"


async def test_non_ascii_download_query_and_disposition(
    http: httpx.AsyncClient, scratch: Path
) -> None:
    target = scratch / "下载 file.txt"
    target.write_text("down")
    response = await http.get("/files", params={"path": str(target)})
    assert (response.status_code, response.content) == (200, b"down")
    quoted = urllib.parse.quote("下载 file.txt", safe="")
    assert response.headers["content-disposition"] == f"inline; filename*=utf-8''{quoted}"
    plain = scratch / "plain.txt"
    plain.write_text("p")
    response = await http.get("/files", params={"path": str(plain)})
    assert response.headers["content-disposition"] == "inline; filename=plain.txt"


# Multipart destinations -------------------------------------------------------------------


async def test_path_parameter_is_every_parts_destination(
    http: httpx.AsyncClient, scratch: Path
) -> None:
    target = scratch / "one.txt"
    response = await http.post(
        "/files",
        params={"path": str(target)},
        files=[("file", ("a.txt", b"1")), ("file", ("b.txt", b"2"))],
    )
    assert response.status_code == 400
    assert "only the first was written" in response.json()["message"]
    assert target.read_bytes() == b"1"
    assert not (scratch / "b.txt").exists()


# Symlinks ---------------------------------------------------------------------------------


async def test_symlink_entries_describe_their_target(
    fs_client: FilesystemClient, scratch: Path
) -> None:
    target = scratch / "target.txt"
    target.write_text("hello")
    os.chmod(target, 0o640)
    (scratch / "dir").mkdir()
    (scratch / "to-file").symlink_to("target.txt")  # relative: the target is still absolute
    (scratch / "chain").symlink_to(scratch / "to-file")
    (scratch / "to-dir").symlink_to(scratch / "dir")
    (scratch / "dangling").symlink_to(scratch / "missing")

    async def stat(name: str) -> pb.EntryInfo:
        entry = (await fs_client.stat(pb.StatRequest(path=str(scratch / name)))).entry
        assert entry is not None
        return entry

    link = await stat("to-file")
    assert (link.type, link.is_symlink, link.symlink_target) == (
        pb.FileType.FILE,
        True,
        str(target),
    )
    assert (link.mode, link.permissions) == (0o640, "Lrwxrwxrwx")
    assert link.size == len("target.txt"), "size, owner and mtime are the link's own"
    chain = await stat("chain")
    assert (chain.type, chain.symlink_target) == (pb.FileType.FILE, str(target))
    to_dir = await stat("to-dir")
    assert (to_dir.type, to_dir.symlink_target) == (pb.FileType.DIRECTORY, str(scratch / "dir"))
    dangling = await stat("dangling")
    assert (dangling.type, dangling.mode, dangling.symlink_target) == (
        pb.FileType.UNSPECIFIED,
        0,
        str(scratch / "dangling"),
    )
    plain = await stat("target.txt")
    assert not plain.is_symlink and not plain.has_field("symlink_target")

    listed = (await fs_client.list_dir(pb.ListDirRequest(path=str(scratch)))).entries
    by_name = {entry.name: entry for entry in listed}
    assert by_name["to-file"] == link and by_name["dangling"] == dangling
    # Listing through a symlinked directory keeps the requested path as the prefix.
    (scratch / "dir" / "inner.txt").write_text("i")
    inner = (await fs_client.list_dir(pb.ListDirRequest(path=str(scratch / "to-dir")))).entries
    assert [entry.path for entry in inner] == [str(scratch / "to-dir" / "inner.txt")]


def test_symlinks_through_the_sdk(sbx: Sandbox, scratch: Path) -> None:
    sbx.files.write(f"{scratch}/t.txt", "x", metadata={"k": "v"})
    (scratch / "link").symlink_to(scratch / "t.txt")
    (scratch / "dangling").symlink_to(scratch / "missing")
    info = sbx.files.get_info(f"{scratch}/link")
    # is_symlink makes the SDK say SYMLINK; the target's metadata is read through the link.
    assert (info.type, info.symlink_target) == (FileType.SYMLINK, f"{scratch}/t.txt")
    assert info.metadata == {"k": "v"}
    assert sbx.files.exists(f"{scratch}/dangling")
    # The SDK drops entries whose type is unspecified: a dangling link is not listed.
    assert sorted(e.name for e in sbx.files.list(str(scratch))) == ["link", "t.txt"]
    sbx.files.remove(f"{scratch}/link")
    assert (scratch / "t.txt").exists(), "removing a link leaves its target"


# Entry fields as Go prints them -----------------------------------------------------------


async def test_mode_and_permissions_as_go_prints_them(
    fs_client: FilesystemClient, scratch: Path
) -> None:
    sticky = (await fs_client.stat(pb.StatRequest(path="/tmp"))).entry
    assert sticky is not None
    assert (sticky.mode, sticky.permissions) == (0o777, "dtrwxrwxrwx")
    setuid = scratch / "setuid"
    setuid.write_text("")
    os.chmod(setuid, 0o4755)
    fifo = scratch / "fifo"
    os.mkfifo(fifo, 0o644)
    entries = {
        e.name: e for e in (await fs_client.list_dir(pb.ListDirRequest(path=str(scratch)))).entries
    }
    assert (entries["setuid"].mode, entries["setuid"].permissions) == (0o755, "urwxr-xr-x")
    assert (entries["fifo"].type, entries["fifo"].permissions) == (
        pb.FileType.UNSPECIFIED,
        "prw-r--r--",
    )
    null = (await fs_client.stat(pb.StatRequest(path="/dev/null"))).entry
    assert null is not None and null.permissions == "Dcrw-rw-rw-"


async def test_empty_path_is_the_home_directory(
    fs_client: FilesystemClient, user_home: Path
) -> None:
    entry = (await fs_client.stat(pb.StatRequest(path=""))).entry
    assert entry is not None and entry.path == str(user_home)


async def test_watch_with_a_filename_in_every_script(
    fs_client: FilesystemClient, scratch: Path
) -> None:
    created = await fs_client.create_watcher(pb.CreateWatcherRequest(path=str(scratch)))
    (scratch / "Ελληνικά.txt").write_text("x")
    names: set[str] = set()
    for _ in range(100):
        events = (
            await fs_client.get_watcher_events(
                pb.GetWatcherEventsRequest(watcher_id=created.watcher_id)
            )
        ).events
        names |= {event.name for event in events}
        if "Ελληνικά.txt" in names:
            break
        await asyncio.sleep(0.05)
    await fs_client.remove_watcher(pb.RemoveWatcherRequest(watcher_id=created.watcher_id))
    assert "Ελληνικά.txt" in names


async def test_a_name_that_is_not_utf8_is_shown_not_fatal(
    fs_client: FilesystemClient, scratch: Path
) -> None:
    # Upstream fails the whole listing over such a name; we show it with U+FFFD instead.
    created = await fs_client.create_watcher(pb.CreateWatcherRequest(path=str(scratch)))
    Path(os.fsdecode(bytes(scratch) + b"/caf\xe9.txt")).write_text("x")
    (scratch / "ok.txt").write_text("y")
    listed = (await fs_client.list_dir(pb.ListDirRequest(path=str(scratch)))).entries
    assert sorted(entry.name for entry in listed) == ["caf\ufffd.txt", "ok.txt"]
    names: set[str] = set()
    for _ in range(100):
        events = (
            await fs_client.get_watcher_events(
                pb.GetWatcherEventsRequest(watcher_id=created.watcher_id)
            )
        ).events
        names |= {event.name for event in events}
        if "ok.txt" in names:
            break
        await asyncio.sleep(0.05)
    await fs_client.remove_watcher(pb.RemoveWatcherRequest(watcher_id=created.watcher_id))
    assert {"caf\ufffd.txt", "ok.txt"} <= names
