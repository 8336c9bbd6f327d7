"""What the JS SDK's `Template.build` puts on the wire, recorded by a stand-in API on
loopback (no server, no VM): the routes and query it uses, the build body our parser must
take as sent, and the upload archives (node-tar, gzip or not) our COPY script must place as
the SDK means them. tests/e2e/test_js_template_build.py runs the same SDK against a live
server; this pins the details that a live build would only show as a failed step.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from jsrun import js_workdir

from agentenv.build.spec import parse
from agentenv.build.steps import copy_script

TEMPLATE_ID = "jsapp"
BUILD_ID = "0b6f6c2e-8d8e-4a52-9a51-3a0c7e1f2d44"
NODE_TIMEOUT_S = 120

SCRIPT = """
import { Template, waitForPort } from 'e2b'
const t = Template({ fileContextPath: process.argv[2] })
  .fromTemplate('base')
  .copy('app', '/app')
  .copy('run.sh', '/app/bin/', { mode: 0o755 })
  .copy('app/*.txt', '/glob/')
  .copy('.', '/whole')
  .copy('run.sh', '/plain', { gzip: false, resolveSymlinks: true, forceUpload: true })
  .setEnvs({ GREETING: 'hello js' })
  .setUser('root')
  .setWorkdir('/app')
  .runCmd(['echo one', 'echo two'], { user: 'user' })
  .setStartCmd('python3 -m http.server 8080', waitForPort(8080))
const info = await Template.build(t, 'jsapp', { cpuCount: 1, memoryMB: 512 })
console.log('INFO=' + JSON.stringify(info))
"""


@dataclass
class Recorded:
    requests: list[tuple[str, str, dict[str, str]]] = field(default_factory=list)
    bodies: dict[str, object] = field(default_factory=dict)
    uploads: dict[str, bytes] = field(default_factory=dict)


def stand_in(rec: Recorded) -> ThreadingHTTPServer:
    """Answers as our server does (docs/template-build.md), and keeps what it was sent."""

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:
            pass

        def body(self) -> bytes:
            if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                out = b""
                while True:
                    size = int(self.rfile.readline().split(b";")[0], 16)
                    chunk = self.rfile.read(size + 2)[:size]
                    if size == 0:
                        return out
                    out += chunk
            return self.rfile.read(int(self.headers.get("Content-Length", "0")))

        def answer(self, code: int, obj: object = None) -> None:
            data = json.dumps(obj).encode() if obj is not None else b""
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def note(self, data: bytes) -> str:
            path = self.path.split("?", 1)[0]
            rec.requests.append(
                (self.command, self.path, {k.lower(): v for k, v in self.headers.items()})
            )
            if data and self.command == "POST":
                rec.bodies[path] = json.loads(data)
            return path

        def do_POST(self) -> None:
            path = self.note(self.body())
            if path == "/v3/templates":
                self.answer(
                    202,
                    {"templateID": TEMPLATE_ID, "buildID": BUILD_ID, "public": False,
                     "names": [TEMPLATE_ID], "tags": ["default"], "aliases": [TEMPLATE_ID]},
                )  # fmt: skip
            else:
                self.answer(202)

        def do_GET(self) -> None:
            path = self.note(b"")
            if "/files/" in path:
                files_hash = path.rsplit("/", 1)[1]
                port = self.server.server_address[1]
                url = f"http://127.0.0.1:{port}/upload/{files_hash}?expires=1&sig=x"
                self.answer(201, {"present": False, "url": url})
            else:
                status = {"templateID": TEMPLATE_ID, "buildID": BUILD_ID, "status": "ready",
                          "logs": [], "logEntries": []}  # fmt: skip
                self.answer(200, status)

        def do_PUT(self) -> None:
            data = self.body()
            path = self.note(b"")
            rec.uploads[path.rsplit("/", 1)[1]] = data
            self.answer(200)

    return ThreadingHTTPServer(("127.0.0.1", 0), Handler)


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Recorded, Path]]:
    if shutil.which("node") is None:
        pytest.fail("node is needed: aenv setup --with-test-tools installs it")
    work = js_workdir(tmp_path_factory.mktemp("js-wire"))
    (work / "wire.mjs").write_text(SCRIPT)
    ctx = tmp_path_factory.mktemp("js-wire-ctx")
    (ctx / "app" / "sub").mkdir(parents=True)
    (ctx / "app" / "hello.txt").write_text("hello\n")
    (ctx / "app" / ".hidden").write_text("dot\n")
    (ctx / "app" / "sub" / "nested.txt").write_text("nested\n")
    (ctx / "run.sh").write_text("#!/bin/sh\necho ran\n")
    rec = Recorded()
    srv = stand_in(rec)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{srv.server_address[1]}"
        env = {k: v for k, v in os.environ.items() if not k.startswith("E2B_")}
        env.update(E2B_API_URL=url, E2B_API_KEY="e2b_wire")
        proc = subprocess.run(
            ["node", "wire.mjs", str(ctx)],
            cwd=work, env=env, capture_output=True, text=True, timeout=NODE_TIMEOUT_S,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert f'"buildId":"{BUILD_ID}"' in proc.stdout, proc.stdout
    finally:
        srv.shutdown()
        srv.server_close()
        thread.join(timeout=10)
    yield rec, ctx


def test_routes_and_auth(recorded: tuple[Recorded, Path]) -> None:
    rec, _ = recorded
    calls = [(m, p.split("?", 1)[0]) for m, p, _ in rec.requests]
    assert calls[0] == ("POST", "/v3/templates")
    links = {p for m, p in calls if m == "GET" and "/files/" in p}
    assert len(links) == 5 and all(p.startswith(f"/templates/{TEMPLATE_ID}/files/") for p in links)
    assert ("POST", f"/v2/templates/{TEMPLATE_ID}/builds/{BUILD_ID}") in calls
    status = [p for m, p, _ in rec.requests if m == "GET" and "/status" in p]
    assert f"/templates/{TEMPLATE_ID}/builds/{BUILD_ID}/status?logsOffset=0" in status
    for method, path, headers in rec.requests:
        # The API key goes to the API; the signed upload link is used without it.
        if method == "PUT":
            assert "x-api-key" not in headers and headers.get("content-length"), headers
            assert path.endswith("?expires=1&sig=x")
        else:
            assert headers.get("x-api-key") == "e2b_wire", (method, path)
    assert rec.bodies["/v3/templates"] == {"name": "jsapp", "cpuCount": 1, "memoryMB": 512}


def test_build_body_parses_as_sent(recorded: tuple[Recorded, Path]) -> None:
    rec, _ = recorded
    spec = parse(rec.bodies[f"/v2/templates/{TEMPLATE_ID}/builds/{BUILD_ID}"])
    assert spec.from_template == "base" and spec.force is False
    assert [(s.type, s.args) for s in spec.steps] == [
        ("COPY", ["app", "/app", "", ""]),
        ("COPY", ["run.sh", "/app/bin/", "", "0755"]),
        ("COPY", ["app/*.txt", "/glob/", "", ""]),
        ("COPY", [".", "/whole", "", ""]),
        ("COPY", ["run.sh", "/plain", "", ""]),
        ("ENV", ["GREETING", "hello js"]),
        ("USER", ["root"]),
        ("WORKDIR", ["/app"]),
        ("RUN", ["echo one && echo two", "user"]),
    ]
    # forceUpload forces the step (a cache miss), as in the Python SDK.
    assert [s.force for s in spec.steps][:5] == [False, False, False, False, True]
    assert all(
        s.files_hash and set(s.files_hash) <= set("0123456789abcdef") for s in spec.steps[:5]
    )
    assert spec.start_cmd == "python3 -m http.server 8080"
    assert spec.ready_cmd == '[ -n "$(ss -Htuln sport = :8080)" ]'


def test_archives_are_placed_as_the_sdk_means(
    recorded: tuple[Recorded, Path], tmp_path: Path
) -> None:
    rec, _ = recorded
    spec = parse(rec.bodies[f"/v2/templates/{TEMPLATE_ID}/builds/{BUILD_ID}"])
    root = tmp_path / "guest"
    for step in spec.steps[:5]:
        assert step.files_hash is not None
        staging = tmp_path / f"{step.files_hash[:16]}.tar"
        staging.write_bytes(rec.uploads[step.files_hash])
        dest = str(root) + step.args[1]
        script = copy_script(step.args[0], dest, "", step.args[3], str(staging))
        subprocess.run(["sh", "-c", script], check=True, capture_output=True, timeout=30)
    # gzip: false sends a plain tar, the rest gzip; both are placed.
    assert rec.uploads[spec.steps[4].files_hash or ""][:2] != b"\x1f\x8b"
    assert rec.uploads[spec.steps[0].files_hash or ""][:2] == b"\x1f\x8b"
    found = sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())
    assert found == [
        "app/.hidden", "app/bin/run.sh", "app/hello.txt", "app/sub/nested.txt",
        "glob/hello.txt", "plain",
        "whole/app/.hidden", "whole/app/hello.txt", "whole/app/sub/nested.txt", "whole/run.sh",
    ]  # fmt: skip
    assert (root / "app/bin/run.sh").stat().st_mode & 0o777 == 0o755
    assert (root / "plain").read_text() == "#!/bin/sh\necho ran\n"
