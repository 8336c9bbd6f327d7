"""The official e2b SDK (2.63) driving envd directly.

`E2B_DEBUG=true` makes `Sandbox.create()` skip the control plane and `E2B_SANDBOX_URL` points
every envd call at our process, so these are the SDK's own requests, byte for byte.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from e2b import AsyncSandbox, FilesystemEventType, Sandbox
from e2b.exceptions import InvalidArgumentException, TimeoutException
from e2b.sandbox.commands.command_handle import CommandExitException, PtySize
from e2b.sandbox.filesystem.filesystem import FileType

from .conftest import EnvdProc


@pytest.fixture
def sdk_env(envd: EnvdProc, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("E2B_DEBUG", "true")
    monkeypatch.setenv("E2B_SANDBOX_URL", envd.url)
    monkeypatch.setenv("E2B_API_KEY", "unused-in-debug-mode")


@pytest.fixture
def sbx(sdk_env: None) -> Iterator[Sandbox]:
    yield Sandbox.create()


def test_run_stdout_stderr_exit(sbx: Sandbox) -> None:
    result = sbx.commands.run("echo out; echo err >&2")
    assert (result.stdout, result.stderr, result.exit_code) == ("out\n", "err\n", 0)
    with pytest.raises(CommandExitException) as err:
        sbx.commands.run("exit 3")
    assert err.value.exit_code == 3


def test_env_cwd_user(sbx: Sandbox) -> None:
    result = sbx.commands.run(
        "echo $FOO; pwd; whoami", cwd="/tmp", user="root", envs={"FOO": "baz"}
    )
    assert result.stdout.split() == ["baz", "/tmp", "root"]
    assert sbx.commands.run("whoami").stdout == "user\n"


def test_streaming_callbacks(sbx: Sandbox) -> None:
    chunks: list[tuple[float, str]] = []
    sbx.commands.run(
        "for i in 1 2 3; do echo $i; sleep 0.3; done",
        on_stdout=lambda line: chunks.append((time.monotonic(), line)),
    )
    assert "".join(c for _, c in chunks) == "1\n2\n3\n"
    assert chunks[-1][0] - chunks[0][0] > 0.4, "output must arrive as it is produced"


def test_background_list_kill(sbx: Sandbox) -> None:
    handle = sbx.commands.run("sleep 100", background=True)
    assert handle.pid in [p.pid for p in sbx.commands.list()]
    assert sbx.commands.kill(handle.pid) is True
    with pytest.raises(CommandExitException) as err:
        handle.wait()
    assert err.value.exit_code == -1
    assert sbx.commands.kill(handle.pid) is False


def test_disconnect_and_reattach(sbx: Sandbox) -> None:
    handle = sbx.commands.run("sleep 1.5; echo done", background=True)
    handle.disconnect()
    time.sleep(0.3)
    again = sbx.commands.connect(handle.pid)
    result = again.wait()
    assert result.stdout == "done\n"


def test_timeout(sbx: Sandbox) -> None:
    with pytest.raises(TimeoutException):
        sbx.commands.run("sleep 10", timeout=1.5)
    time.sleep(0.3)
    assert not [p for p in sbx.commands.list() if p.cmd == "/bin/bash" and "sleep 10" in p.args[-1]]


def test_stdin(sbx: Sandbox) -> None:
    handle = sbx.commands.run("cat", background=True, stdin=True)
    sbx.commands.send_stdin(handle.pid, "abc\n")
    sbx.commands.close_stdin(handle.pid)
    assert handle.wait().stdout == "abc\n"


def test_pty(sbx: Sandbox) -> None:
    terminal = sbx.pty.create(PtySize(24, 80))
    output = bytearray()
    done = threading.Event()

    def wait() -> None:
        with contextlib.suppress(CommandExitException):
            terminal.wait(on_pty=output.extend)
        done.set()

    thread = threading.Thread(target=wait)
    thread.start()

    def wait_for(marker: bytes) -> None:
        for _ in range(200):
            if marker in output:
                return
            time.sleep(0.05)
        raise AssertionError(f"{marker!r} never came: {bytes(output)[-300:]!r}")

    sbx.pty.send_stdin(terminal.pid, b"stty size; echo A-$((1+1))\n")
    wait_for(b"A-2")
    sbx.pty.resize(terminal.pid, PtySize(30, 100))
    sbx.pty.send_stdin(terminal.pid, b"stty size; echo B-$((2+2))\n")
    wait_for(b"B-4")
    assert sbx.pty.kill(terminal.pid)
    thread.join(10)
    assert done.is_set()
    assert b"24 80" in output and b"30 100" in output


def test_files(sbx: Sandbox, scratch: Path) -> None:
    base = str(scratch)
    info = sbx.files.write(f"{base}/a.txt", "hello")
    assert (info.name, info.path) == ("a.txt", f"{base}/a.txt")
    sbx.files.write_files(
        [{"path": f"{base}/m/1.txt", "data": "one"}, {"path": f"{base}/m/2.bin", "data": b"\x00"}]
    )
    assert sbx.files.read(f"{base}/a.txt") == "hello"
    assert sbx.files.read(f"{base}/m/2.bin", format="bytes") == bytearray(b"\x00")
    assert sbx.files.exists(f"{base}/a.txt") and not sbx.files.exists(f"{base}/missing")
    entry = sbx.files.get_info(f"{base}/a.txt")
    assert (entry.type, entry.size, entry.permissions, entry.owner) == (
        FileType.FILE,
        5,
        "-rw-r--r--",
        "user",
    )
    names = {e.name for e in sbx.files.list(base, depth=2)}
    assert {"a.txt", "m", "1.txt", "2.bin"} <= names
    assert sbx.files.make_dir(f"{base}/new") is True
    assert sbx.files.make_dir(f"{base}/new") is False
    assert sbx.files.rename(f"{base}/a.txt", f"{base}/b.txt").path == f"{base}/b.txt"
    sbx.files.remove(f"{base}/b.txt")
    assert not sbx.files.exists(f"{base}/b.txt")
    from e2b.exceptions import NotFoundException

    with pytest.raises(NotFoundException):
        sbx.files.read(f"{base}/nope")
    sbx.files.write(f"{base}/root.bin", b"\x00\x01", user="root")
    assert sbx.files.get_info(f"{base}/root.bin").owner == "root"
    sbx.files.write(f"{base}/meta.txt", "m", metadata={"owner": "me"})
    assert sbx.files.get_info(f"{base}/meta.txt").metadata == {"owner": "me"}


def test_streaming_upload_and_download(sbx: Sandbox, scratch: Path, tmp_path: Path) -> None:
    source = tmp_path / "src.bin"
    source.write_bytes(bytes(range(256)) * 40_000)
    with source.open("rb") as f:
        sbx.files.write(f"{scratch}/big.bin", f)
    data = sbx.files.read(f"{scratch}/big.bin", format="bytes")
    assert bytes(data) == source.read_bytes()
    sbx.files.write(f"{scratch}/gz.bin", source.read_bytes(), gzip=True)
    streamed = b"".join(sbx.files.read(f"{scratch}/gz.bin", format="stream", gzip=True))
    assert streamed == source.read_bytes()


def test_sync_watch(sbx: Sandbox, scratch: Path) -> None:
    watcher = sbx.files.watch_dir(str(scratch), recursive=True)
    sbx.files.write(f"{scratch}/w.txt", "x")
    events = []
    for _ in range(40):
        events += watcher.get_new_events()
        if any(e.type == FilesystemEventType.WRITE for e in events):
            break
        time.sleep(0.05)
    watcher.stop()
    kinds = {(e.name, e.type) for e in events}
    assert ("w.txt", FilesystemEventType.CREATE) in kinds
    assert ("w.txt", FilesystemEventType.WRITE) in kinds


async def test_async_watch_and_commands(sdk_env: None, scratch: Path) -> None:
    import asyncio

    sbx = await AsyncSandbox.create()
    seen: list[tuple[str, FilesystemEventType]] = []
    got = asyncio.Event()

    def on_event(event: object) -> None:
        seen.append((event.name, event.type))  # type: ignore[attr-defined]
        if event.type == FilesystemEventType.WRITE:  # type: ignore[attr-defined]
            got.set()

    handle = await sbx.files.watch_dir(str(scratch), on_event=on_event, timeout=10)
    await sbx.files.write(f"{scratch}/aw.txt", "x")
    await asyncio.wait_for(got.wait(), 10)
    await handle.stop()
    assert ("aw.txt", FilesystemEventType.CREATE) in seen
    result = await sbx.commands.run("echo async")
    assert result.stdout == "async\n"


def test_twenty_concurrent_background_commands(sbx: Sandbox) -> None:
    handles = [sbx.commands.run(f"sleep 1; echo n{i}", background=True) for i in range(20)]
    listed = {p.pid for p in sbx.commands.list()}
    assert {h.pid for h in handles} <= listed
    outputs = [h.wait().stdout for h in handles]
    assert outputs == [f"n{i}\n" for i in range(20)]


def test_command_leaving_a_background_server_returns(sbx: Sandbox, scratch: Path) -> None:
    """`server &` ends when the shell exits, not at its timeout; the server runs on."""
    from .conftest import free_port

    port = free_port()
    pid_file = scratch / "server.pid"
    started = time.monotonic()
    try:
        result = sbx.commands.run(
            f"python3 -m http.server {port} --bind 127.0.0.1 & echo $! > {pid_file}; echo started",
            timeout=30,
        )
        took = time.monotonic() - started
        assert (result.stdout, result.exit_code) == ("started\n", 0)
        assert took < 10, f"the command took {took:.1f}s: it waited for the server's pipes"
        probe = (
            f"for i in $(seq 100); do curl -sf http://127.0.0.1:{port}/ >/dev/null && "
            "echo up && exit 0; sleep 0.1; done; exit 1"
        )
        # Twice: the server logs each request to the stdout/stderr it inherited.
        assert sbx.commands.run(probe, timeout=30).stdout == "up\n"
        assert sbx.commands.run(probe, timeout=30).stdout == "up\n"
    finally:
        with contextlib.suppress(FileNotFoundError, ValueError, ProcessLookupError):
            os.kill(int(pid_file.read_text()), signal.SIGTERM)


def test_read_procfs_file_then_keep_going(sbx: Sandbox) -> None:
    """procfs says 0 bytes; the content must come whole and the connection stay usable."""
    boot_id = Path("/proc/sys/kernel/random/boot_id").read_text()
    assert sbx.files.read("/proc/sys/kernel/random/boot_id") == boot_id
    assert sbx.files.read("/proc/sys/kernel/random/boot_id") == boot_id
    assert sbx.commands.run("echo next").stdout == "next\n"
    assert "MemTotal" in sbx.files.read("/proc/meminfo")
    assert sbx.files.read("/dev/null") == ""


def test_remove_missing_path_is_not_an_error(sbx: Sandbox, scratch: Path) -> None:
    # Upstream's Remove is os.RemoveAll, which succeeds when there is nothing to remove.
    sbx.files.remove(f"{scratch}/never-existed")
    sbx.files.remove(f"{scratch}/no/such/dir")
    sbx.files.write(f"{scratch}/f.txt", "x")
    sbx.files.remove(f"{scratch}/f.txt")
    sbx.files.remove(f"{scratch}/f.txt")
    assert not sbx.files.exists(f"{scratch}/f.txt")


def test_relative_cwd_starts_at_home(sbx: Sandbox, scratch: Path, user_home: Path) -> None:
    relative = os.path.relpath(scratch, user_home)
    assert sbx.commands.run("pwd", cwd=relative).stdout == f"{scratch}\n"
    assert sbx.commands.run("pwd", cwd="~").stdout == f"{user_home}\n"
    assert sbx.commands.run("pwd", cwd=f"~/{relative}").stdout == f"{scratch}\n"
    assert sbx.commands.run("pwd", cwd="/tmp/../tmp").stdout == "/tmp\n"
    assert sbx.commands.run("pwd", cwd=f"{relative}/..").stdout == f"{user_home}\n"
    with pytest.raises(InvalidArgumentException) as err:
        sbx.commands.run("pwd", cwd="no-such-dir-here")
    assert f"cwd '{user_home}/no-such-dir-here' does not exist" in str(err.value)


def test_overwrite_replaces_metadata(sbx: Sandbox, scratch: Path) -> None:
    path = f"{scratch}/meta.txt"
    info = sbx.files.write(path, "1", metadata={"a": "1", "b": "2"})
    assert info.metadata == {"a": "1", "b": "2"}
    assert sbx.files.get_info(path).metadata == {"a": "1", "b": "2"}
    info = sbx.files.write(path, "2", metadata={"a": "3"})
    assert info.metadata == {"a": "3"}
    assert sbx.files.get_info(path).metadata == {"a": "3"}
    info = sbx.files.write(path, "3")
    assert not info.metadata
    assert not sbx.files.get_info(path).metadata
    assert sbx.files.read(path) == "3"


def test_write_creates_missing_parents_for_the_user(
    sbx: Sandbox, scratch: Path, user_home: Path
) -> None:
    uid = pwd.getpwnam("user").pw_uid
    # Straight under the home directory, as in `files.write("/home/user/a/b/c.txt")`.
    top = user_home / f"envd-parents-{os.getpid()}-{time.monotonic_ns()}"
    try:
        info = sbx.files.write(f"{top}/a/b/c.txt", "deep")
        assert info.path == f"{top}/a/b/c.txt"
        assert (top / "a" / "b" / "c.txt").read_text() == "deep"
        for path in (top, top / "a", top / "a" / "b", top / "a" / "b" / "c.txt"):
            assert path.stat().st_uid == uid, path
    finally:
        shutil.rmtree(top, ignore_errors=True)
    # Several files in one multipart upload (no `path`: each part's filename is its path).
    sbx.files.write_files(
        [
            {"path": f"{scratch}/x/1.txt", "data": "one"},
            {"path": f"{scratch}/y/z/2.txt", "data": "two"},
        ]
    )
    assert (scratch / "y" / "z" / "2.txt").read_text() == "two"
    assert (scratch / "y" / "z").stat().st_uid == uid
    # The missing parents may start below a directory the user cannot write (as `/` is):
    # upstream's EnsureDirs makes them anyway, and gives them to the user.
    locked = scratch / "locked"
    locked.mkdir(mode=0o755)
    os.chown(locked, 0, 0)
    sbx.files.write(f"{locked}/new/file.txt", "ok")
    assert (locked / "new").stat().st_uid == uid
    # And a file straight into it: upstream writes as root and gives the file to the user.
    sbx.files.write(f"{locked}/file.txt", "yes")
    assert (locked / "file.txt").stat().st_uid == uid
    assert locked.stat().st_uid == 0
    # A path through a file is a bad request, not a crash.
    with pytest.raises(InvalidArgumentException):
        sbx.files.write(f"{scratch}/x/1.txt/under-a-file.txt", "no")


# Names that are not ASCII, and ASCII that means something in a URL or a query.
ODD_DIR = "目录 ñ 🚀"
ODD_NAME = "文件 é+&#?%20=;ü.txt"


def test_non_ascii_names_through_every_sdk_route(
    sbx: Sandbox, scratch: Path, user_home: Path
) -> None:
    """The same odd names in query parameters (`GET`/`POST /files?path=`, the SDK's download
    and upload URLs), RPC paths (make_dir, list, get_info, rename, remove), a watch's events
    and a command's cwd, args and env: each arrives as written, none is doubly decoded."""
    base = f"{scratch}/{ODD_DIR}"
    assert sbx.files.make_dir(base) is True
    watcher = sbx.files.watch_dir(base)
    try:
        info = sbx.files.write(f"{base}/{ODD_NAME}", "é 🚀")
        assert (info.name, info.path) == (ODD_NAME, f"{base}/{ODD_NAME}")
        assert (Path(base) / ODD_NAME).read_text() == "é 🚀"
        events: list[tuple[str, FilesystemEventType]] = []
        deadline = time.monotonic() + 10
        while not any(t == FilesystemEventType.WRITE for _, t in events):
            assert time.monotonic() < deadline, events
            events += [(e.name, e.type) for e in watcher.get_new_events()]
            time.sleep(0.05)
        assert (ODD_NAME, FilesystemEventType.CREATE) in events
    finally:
        watcher.stop()
    assert sbx.files.read(f"{base}/{ODD_NAME}") == "é 🚀"
    assert [e.name for e in sbx.files.list(base)] == [ODD_NAME]
    assert sbx.files.get_info(f"{base}/{ODD_NAME}").path == f"{base}/{ODD_NAME}"
    assert sbx.files.exists(f"{base}/{ODD_NAME}")
    # Relative to the user's home, as upstream resolves a relative path.
    rel = f"{base}/{ODD_NAME}".removeprefix(f"{user_home}/")
    assert sbx.files.read(rel) == "é 🚀"

    with httpx.Client(timeout=30) as http:
        got = http.get(sbx.download_url(f"{base}/{ODD_NAME}"))
        assert got.status_code == 200, got.text
        assert got.content == "é 🚀".encode()
        up = http.post(
            sbx.upload_url(f"{base}/上传 ü.bin"), files={"file": ("ignored", b"\x00\xff")}
        )
        assert up.status_code == 200, up.text
        assert up.json()[0]["path"] == f"{base}/上传 ü.bin"
    assert (Path(base) / "上传 ü.bin").read_bytes() == b"\x00\xff"

    result = sbx.commands.run(f"ls; echo \"$ODD\" '{ODD_DIR}'", cwd=base, envs={"ODD": "ñ 🚀"})
    assert result.stdout.splitlines() == [*sorted([ODD_NAME, "上传 ü.bin"]), f"ñ 🚀 {ODD_DIR}"]
    moved = sbx.files.rename(f"{base}/{ODD_NAME}", f"{base}/ünï 😀.txt")
    assert (moved.name, moved.path) == ("ünï 😀.txt", f"{base}/ünï 😀.txt")
    sbx.files.remove(base)
    assert not sbx.files.exists(base)
