"""An agent backend's flow through the official Python SDK, as the default user, on one real
microVM: a root-level workspace dir, 50 files in one multipart upload (non-ASCII names,
nested dirs), a recursive listing, a command in that dir, a pause and resume, reads back.
Then non-ASCII names through the server (the proxy, signed URLs, watches) with the Python
and the JS SDK (tests/e2e/js/nonascii.mjs, run by node) on a second sandbox."""

from __future__ import annotations

import hashlib
import time
import uuid
from pathlib import Path

import httpx
import pytest
from api.conftest import REQUEST_TIMEOUT_S
from e2b import FilesystemEventType, FileType, Sandbox
from e2b.exceptions import SandboxNotRunningException
from e2b.sandbox.filesystem.filesystem import WriteEntry
from jsrun import JsEnv, js_workdir, node

from agentenv.api.devserver import ServerProcess

pytestmark = pytest.mark.vm

RT = REQUEST_TIMEOUT_S
ROOT = "/workspace"
# Relative names, a mix an agent would upload: plain, accents, CJK, emoji, a space, nested.
NAMES = [
    *(f"plain-{i:02d}.txt" for i in range(10)),
    *(f"café-{i}.py" for i in range(5)),
    *(f"日本語/ファイル{i}.md" for i in range(5)),
    *(f"中文/深/层/数据{i}.csv" for i in range(5)),
    *(f"emoji/🚀 launch {i}.json" for i in range(5)),
    *(f"señal/Ünïcödé/ñ{i}.bin" for i in range(5)),
    *(f"src/pkg/mod_{i}.py" for i in range(10)),
    *(f"한국어-{i}.txt" for i in range(5)),
]


def content(name: str) -> bytes:
    """Distinct per file, binary (every byte value) and of varied length."""
    digest = hashlib.sha256(name.encode()).digest()
    return digest + bytes(range(256)) * (1 + len(name) % 7) + name.encode()


@pytest.fixture(autouse=True)
def sdk_env(server: ServerProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    """The SDK finds the server through its environment (as a user would set it up)."""
    for key, value in server.sdk_env().items():
        monkeypatch.setenv(key, value)


def test_agent_backend_flow_as_default_user(server: ServerProcess) -> None:
    assert len(NAMES) == 50 and len(set(NAMES)) == 50
    sbx = Sandbox.create(template="base", timeout=600, request_timeout=RT)
    sid = sbx.sandbox_id
    try:
        assert sbx.commands.run("whoami").stdout.strip() == "user"
        # A root-level dir the default user could not make itself: envd makes it and gives it
        # to the user, as upstream's EnsureDirs does.
        assert sbx.files.make_dir(ROOT) is True
        assert sbx.commands.run(f"stat -c %U {ROOT}").stdout.strip() == "user"

        entries = [WriteEntry(path=f"{ROOT}/{n}", data=content(n)) for n in NAMES]
        written = sbx.files.write_files(entries, request_timeout=RT)
        assert sorted(w.path for w in written) == sorted(f"{ROOT}/{n}" for n in NAMES)

        listed = sbx.files.list(ROOT, depth=10, request_timeout=RT)
        files = {e.path: e for e in listed if e.type == FileType.FILE}
        assert sorted(files) == sorted(f"{ROOT}/{n}" for n in NAMES)
        for name in NAMES:
            entry = files[f"{ROOT}/{name}"]
            assert entry.name == name.rsplit("/", 1)[-1]
            assert entry.size == len(content(name))
            assert entry.owner == "user"
        dirs = {e.path for e in listed if e.type == FileType.DIR}
        expected_dirs = {
            f"{ROOT}/" + "/".join(n.split("/")[:depth])
            for n in NAMES
            for depth in range(1, n.count("/") + 1)
        }
        assert dirs == expected_dirs

        top = {n.split("/", 1)[0] for n in NAMES}
        result = sbx.commands.run("ls | wc -l", cwd=ROOT)
        assert (result.exit_code, result.stdout.strip()) == (0, str(len(top)))
        # The names as the guest's own tools see them: the same UTF-8 bytes.
        found = sbx.commands.run("find . -type f -printf '%P\\n'", cwd=ROOT).stdout
        assert sorted(found.splitlines()) == sorted(NAMES)

        assert sbx.pause() is True
        again = Sandbox.connect(sid, request_timeout=RT)
        for name in NAMES[::6]:
            got = again.files.read(f"{ROOT}/{name}", format="bytes", request_timeout=RT)
            assert bytes(got) == content(name), name
        assert again.commands.run("ls | wc -l", cwd=ROOT).stdout.strip() == str(len(top))
    finally:
        Sandbox.kill(sid, request_timeout=RT)


ODD_DIR = "/home/user/目录 ñ 🚀"
# Not ASCII, and ASCII that means something in a URL or a query.
ODD_NAME = "文件 é+&#?%20=;ü.txt"


def test_non_ascii_names_through_the_server(server: ServerProcess, tmp_path: Path) -> None:
    """Through the proxy: query parameters, RPC paths, a watch's events, the signed download
    and upload URLs (the server finds the sandbox by a signature over the decoded path), with
    the Python SDK and then the JS SDK on the same sandbox."""
    sbx = Sandbox.create(template="base", timeout=600, request_timeout=RT)
    try:
        path = f"{ODD_DIR}/{ODD_NAME}"
        assert sbx.files.make_dir(ODD_DIR) is True
        watcher = sbx.files.watch_dir(ODD_DIR, request_timeout=RT)
        try:
            assert sbx.files.write(path, "é 🚀").path == path
            seen: list[tuple[str, FilesystemEventType]] = []
            deadline = time.monotonic() + 60
            while (ODD_NAME, FilesystemEventType.WRITE) not in seen:
                assert time.monotonic() < deadline, f"no write event: {seen}"
                seen += [(e.name, e.type) for e in watcher.get_new_events()]
                time.sleep(0.1)
            assert (ODD_NAME, FilesystemEventType.CREATE) in seen
        finally:
            watcher.stop()
        assert [e.name for e in sbx.files.list(ODD_DIR)] == [ODD_NAME]
        assert sbx.files.read(path) == "é 🚀"
        with httpx.Client(timeout=RT) as http:
            got = http.get(sbx.download_url(path))
            assert (got.status_code, got.content) == (200, "é 🚀".encode()), got.text
            target = f"{ODD_DIR}/上传 ü.bin"
            up = http.post(sbx.upload_url(target), files={"file": ("x", b"\x00\xff")})
            assert up.status_code == 200, up.text
            assert up.json()[0]["path"] == target
        assert bytes(sbx.files.read(target, format="bytes")) == b"\x00\xff"
        ls = sbx.commands.run("ls", cwd=ODD_DIR).stdout.splitlines()
        assert ls == sorted([ODD_NAME, "上传 ü.bin"])

        js = JsEnv(server, js_workdir(tmp_path), uuid.uuid4().hex[:12])
        node(js, "nonascii.mjs", "non_ascii", sbx.sandbox_id)
    finally:
        sbx.kill()


def test_a_kill_while_a_command_streams_raises_the_killed_error(server: ServerProcess) -> None:
    """The real chain (proxy, node, guest): killing the sandbox under an open `Start` stream
    ends it with the proxy's `unavailable` frame; the SDK probes `/health`, gets the 502 of a
    sandbox that is gone and raises SandboxNotRunningException saying it was killed."""
    sbx = Sandbox.create(template="base", timeout=600, request_timeout=RT)
    try:
        handle = sbx.commands.run("echo started; sleep 600", background=True, timeout=0)
        deadline = time.monotonic() + 60
        while "sbx" not in sbx.commands.run("pgrep -f 'sleep 60[0]' && echo sbx || true").stdout:
            assert time.monotonic() < deadline, "the command never started"
            time.sleep(0.2)
        assert Sandbox.kill(sbx.sandbox_id, request_timeout=RT) is True
        with pytest.raises(SandboxNotRunningException) as caught:
            handle.wait()
        assert "killed or reached its end of life" in str(caught.value)
        assert "ended before the stream completed" in str(caught.value)
    finally:
        Sandbox.kill(sbx.sandbox_id, request_timeout=RT)
