"""E2B SDK compatibility scenarios (e2b-protocol.md §5), run as a script by tests/e2e/test_sdk.py.

It runs in whichever venv holds the SDK version under test (the project venv for the pinned
latest, a cached venv for older pins), so it imports only the SDK, httpx and the stdlib (and
`websockets` when present). Usage:

    python sdk_scenarios.py --leg latest|v1 --out results.json

with E2B_API_URL, E2B_SANDBOX_URL and E2B_API_KEY set. Each scenario records ok/error and its
duration; one failing scenario does not stop the others.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import os
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import httpx
from e2b import CommandExitException, FileNotFoundException, Sandbox, SandboxQuery, SandboxState
from e2b import exceptions as e2b_exc

try:
    from e2b import PtySize
except ImportError:  # pragma: no cover - older SDKs
    from e2b.sandbox.commands.command_handle import PtySize  # type: ignore[no-redef]

URL = os.environ["E2B_API_URL"]
KEY = os.environ["E2B_API_KEY"]
DOMAIN = os.environ.get("AGENTENV_TEST_DOMAIN", "sbx.test")
BIG_MB = int(os.environ.get("AGENTENV_TEST_BIG_MB", "100"))
HTTP_PORT = int(os.environ.get("AGENTENV_TEST_HTTP_PORT", "8080"))
WS_PORT = HTTP_PORT + 1
# The sandbox user's home (only changed for dry runs against host-process sandboxes).
HOME = os.environ.get("AGENTENV_TEST_HOME", "/home/user")
LIST_META = {"k": "v w&x"}

# A stdlib-only HTTP + WebSocket echo server for inside the guest (one process: two ports).
GUEST_SERVER = r"""
import base64, hashlib, http.server, socketserver, struct, sys, threading

class Http(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def do_GET(self):
        body = ("hello from %s %s" % (self.headers.get("host"), self.path)).encode()
        self.send_response(200)
        self.send_header("content-type", "text/plain")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a):
        pass

GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"

class Ws(socketserver.StreamRequestHandler):
    def handle(self):
        key = None
        while True:
            line = self.rfile.readline()
            if line in (b"\r\n", b""):
                break
            name, _, value = line.decode().partition(":")
            if name.strip().lower() == "sec-websocket-key":
                key = value.strip().encode()
        accept = base64.b64encode(hashlib.sha1(key + GUID).digest())
        self.wfile.write(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n"
                         b"Connection: Upgrade\r\nSec-WebSocket-Accept: " + accept + b"\r\n\r\n")
        while True:
            head = self.rfile.read(2)
            if len(head) < 2:
                return
            opcode, n = head[0] & 0x0F, head[1] & 0x7F
            if n == 126:
                n = struct.unpack(">H", self.rfile.read(2))[0]
            elif n == 127:
                n = struct.unpack(">Q", self.rfile.read(8))[0]
            mask = self.rfile.read(4) if head[1] & 0x80 else b"\0\0\0\0"
            data = bytes(b ^ mask[i % 4] for i, b in enumerate(self.rfile.read(n)))
            if opcode == 8:
                self.wfile.write(b"\x88\x00")
                return
            if opcode == 9:
                opcode = 10
            if n < 126:
                hdr = struct.pack(">BB", 0x80 | opcode, n)
            elif n < 65536:
                hdr = struct.pack(">BBH", 0x80 | opcode, 126, n)
            else:
                hdr = struct.pack(">BBQ", 0x80 | opcode, 127, n)
            self.wfile.write(hdr + data)

class TS(socketserver.ThreadingMixIn, socketserver.TCPServer):
    allow_reuse_address = True
    daemon_threads = True

threading.Thread(target=TS(("0.0.0.0", int(sys.argv[2])), Ws).serve_forever, daemon=True).start()
http.server.ThreadingHTTPServer(("0.0.0.0", int(sys.argv[1])), Http).serve_forever()
"""


class Check(AssertionError):
    pass


def check(cond: object, what: str) -> None:
    if not cond:
        raise Check(what)


def raises(exc: type[BaseException], fn: Callable[[], object]) -> BaseException:
    try:
        fn()
    except exc as e:
        return e
    raise Check(f"expected {exc.__name__}")


class Run:
    def __init__(self) -> None:
        self.results: list[dict[str, Any]] = []
        self.state: dict[str, Any] = {}

    def scenario(self, name: str, fn: Callable[[], object]) -> None:
        started = time.monotonic()
        try:
            fn()
            self.results.append({"scenario": name, "ok": True})
        except Exception as exc:
            self.results.append(
                {
                    "scenario": name,
                    "ok": False,
                    "error": f"{type(exc).__name__}: {exc}",
                    "trace": traceback.format_exc(limit=6),
                }
            )
        self.results[-1]["seconds"] = round(time.monotonic() - started, 2)


def now() -> datetime:
    return datetime.now(UTC)


# -- scenarios -------------------------------------------------------------------------------


def create_and_info(r: Run) -> None:
    t0 = time.monotonic()
    s = Sandbox.create(
        template="base",
        timeout=600,
        metadata={"suite": "x y", **LIST_META},
        envs={"FOO": "bar"},
        request_timeout=300,
    )
    r.state["create_s"] = round(time.monotonic() - t0, 2)
    r.state["s"] = s
    check(s.sandbox_id, "empty sandbox id")
    info = s.get_info()
    check(info.metadata == {"suite": "x y", **LIST_META}, f"metadata {info.metadata}")
    check(info.state == SandboxState.RUNNING, f"state {info.state}")
    left = (info.end_at - now()).total_seconds()
    check(590 < left <= 601, f"end_at is {left:.0f} s away")
    check(s.is_running(), "is_running() false")


def run_output(r: Run) -> None:
    s: Sandbox = r.state["s"]
    res = s.commands.run("echo out; echo err >&2")
    check((res.stdout, res.stderr, res.exit_code) == ("out\n", "err\n", 0), repr(res))
    e = raises(CommandExitException, lambda: s.commands.run("exit 3"))
    check(e.exit_code == 3, f"exit code {e.exit_code}")  # type: ignore[attr-defined]


def env_cwd_user(r: Run) -> None:
    s: Sandbox = r.state["s"]
    res = s.commands.run("echo $FOO; pwd; whoami", cwd="/tmp", user="root")
    check(res.stdout.split() == ["bar", "/tmp", "root"], repr(res.stdout))
    check(s.commands.run("echo $FOO", envs={"FOO": "baz"}).stdout == "baz\n", "env override")


def streaming(r: Run) -> None:
    s: Sandbox = r.state["s"]
    seen: list[tuple[float, str]] = []
    s.commands.run(
        "for i in 1 2 3; do echo $i; sleep 1; done",
        on_stdout=lambda line: seen.append((time.monotonic(), line)),
    )
    check(len(seen) >= 3, f"{len(seen)} callbacks")
    check(seen[-1][0] - seen[0][0] > 1.5, "output arrived all at once")


def background_kill(r: Run) -> None:
    s: Sandbox = r.state["s"]
    h = s.commands.run("sleep 100", background=True)
    check(h.pid in [p.pid for p in s.commands.list()], "pid not listed")
    check(s.commands.kill(h.pid) is True, "first kill")
    e = raises(CommandExitException, h.wait)
    check(e.exit_code == -1, f"exit code {e.exit_code}")  # type: ignore[attr-defined]
    check(s.commands.kill(h.pid) is False, "second kill")


def background_child(r: Run) -> None:
    s: Sandbox = r.state["s"]
    # The shell exits at once and leaves a child running with its output redirected: the
    # command ends with the shell, not with the child.
    t0 = time.monotonic()
    res = s.commands.run("python3 -m http.server 8000 >/dev/null 2>&1 & echo started", timeout=60)
    took = time.monotonic() - t0
    check((res.stdout, res.exit_code) == ("started\n", 0), repr(res))
    check(took < 15, f"run took {took:.1f} s: it waited for the background child")
    probe = (
        'python3 -c "import urllib.request; '
        "print(urllib.request.urlopen('http://127.0.0.1:8000/', timeout=5).status)\""
    )
    deadline = time.monotonic() + 60
    status = ""
    while time.monotonic() < deadline and status != "200":
        with contextlib.suppress(CommandExitException):
            status = s.commands.run(probe, timeout=30).stdout.strip()
        if status != "200":
            time.sleep(0.5)
    check(status == "200", f"the background http.server does not answer ({status!r})")


def stdin(r: Run) -> None:
    s: Sandbox = r.state["s"]
    h = s.commands.run("cat", background=True, stdin=True)
    s.commands.send_stdin(h.pid, "abc\n")
    if hasattr(s.commands, "stream_input"):
        s.commands.stream_input(h.pid, ["x", b"y"])
        expected = "abc\nxy"
    else:
        expected = "abc\n"
    s.commands.close_stdin(h.pid)
    res = h.wait()
    check(res.stdout == expected, repr(res.stdout))


def pty(r: Run) -> None:
    import threading

    s: Sandbox = r.state["s"]
    out = bytearray()
    p = s.pty.create(PtySize(rows=24, cols=80))
    ended: list[BaseException | None] = []

    def wait() -> None:
        try:
            p.wait(on_pty=out.extend)
            ended.append(None)
        except BaseException as exc:
            ended.append(exc)

    waiter = threading.Thread(target=wait, daemon=True)
    waiter.start()
    s.pty.send_stdin(p.pid, b"echo hi-$((40+2))\n")
    s.pty.resize(p.pid, PtySize(rows=30, cols=100))
    s.pty.send_stdin(p.pid, b"stty size\n")
    # A login shell under emulation takes a few seconds before it reads its input.
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not (b"hi-42" in out and b"30 100" in out):
        time.sleep(0.2)
    s.pty.kill(p.pid)
    waiter.join(30)
    text = out.decode(errors="replace")
    check("hi-42" in text, f"no echo output in {text[-200:]!r}")
    check("30 100" in text, f"resize not seen in {text[-200:]!r}")
    check(ended and isinstance(ended[0], CommandExitException), f"pty end: {ended}")
    check(ended[0].exit_code == -1, f"exit {ended[0]}")  # type: ignore[union-attr]


def files(r: Run) -> None:
    s: Sandbox = r.state["s"]
    fs = s.files
    info = fs.write(f"{HOME}/a.txt", "hello")
    check((info.name, info.path) == ("a.txt", f"{HOME}/a.txt"), repr(info))
    fs.write_files(
        [
            {"path": f"{HOME}/d/b.txt", "data": "bee"},
            {"path": f"{HOME}/d/c.bin", "data": b"\x00\x01"},
        ]
    )
    check(fs.read(f"{HOME}/a.txt") == "hello", "read text")
    check(bytes(fs.read(f"{HOME}/d/c.bin", format="bytes")) == b"\x00\x01", "read bytes")
    check(fs.exists(f"{HOME}/a.txt") and not fs.exists("/missing"), "exists")
    entry = fs.get_info(f"{HOME}/a.txt")
    check(entry.size == 5 and entry.permissions and entry.modified_time, repr(entry))
    names = {e.path for e in fs.list(f"{HOME}", depth=2)}
    check({f"{HOME}/a.txt", f"{HOME}/d/b.txt", f"{HOME}/d"} <= names, repr(names))
    check(fs.make_dir(f"{HOME}/nd") is True, "make_dir new")
    check(fs.make_dir(f"{HOME}/nd") is False, "make_dir existing")
    fs.rename(f"{HOME}/a.txt", f"{HOME}/a2.txt")
    check(fs.exists(f"{HOME}/a2.txt") and not fs.exists(f"{HOME}/a.txt"), "rename")
    fs.remove(f"{HOME}/a2.txt")
    check(not fs.exists(f"{HOME}/a2.txt"), "remove")
    raises(FileNotFoundException, lambda: fs.read("/nope"))


def watch(r: Run) -> None:
    s: Sandbox = r.state["s"]
    s.files.make_dir(f"{HOME}/w")
    w = s.files.watch_dir(f"{HOME}/w", recursive=True)
    s.files.write(f"{HOME}/w/new.txt", "x")
    events: list[Any] = []
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not any(e.name == "new.txt" for e in events):
        time.sleep(0.3)
        events += w.get_new_events()
    w.stop()
    kinds = {str(e.type).split(".")[-1].lower() for e in events if e.name == "new.txt"}
    check({"create", "write"} & kinds, f"events {events}")


def big_file(r: Run) -> None:
    s: Sandbox = r.state["s"]
    block = os.urandom(1 << 20)
    digest = hashlib.sha256()
    with tempfile.NamedTemporaryFile() as f:
        for _ in range(BIG_MB):
            f.write(block)
            digest.update(block)
        f.flush()
        f.seek(0)
        t0 = time.monotonic()
        s.files.write(f"{HOME}/big.bin", f)
        r.state["upload_s"] = round(time.monotonic() - t0, 2)
    expected = digest.hexdigest()
    guest = s.commands.run(f"sha256sum {HOME}/big.bin", timeout=300).stdout.split()[0]
    check(guest == expected, "guest-side sha256 differs")
    t0 = time.monotonic()
    down = hashlib.sha256()
    for chunk in s.files.read(f"{HOME}/big.bin", format="stream"):
        down.update(chunk)
    r.state["download_s"] = round(time.monotonic() - t0, 2)
    check(down.hexdigest() == expected, "downloaded sha256 differs")
    s.files.remove(f"{HOME}/big.bin")


def connect_by_id(r: Run) -> None:
    s: Sandbox = r.state["s"]
    s2 = Sandbox.connect(s.sandbox_id)
    check(s2.sandbox_id == s.sandbox_id, "other id")
    check(s2.commands.run("echo again").stdout == "again\n", "command after connect")
    Sandbox.connect(s.sandbox_id, timeout=600)


def secure_token(r: Run) -> None:
    s: Sandbox = r.state["s"]
    token = s._envd_access_token
    check(token, "no envdAccessToken on a v2 sandbox")
    hdrs = {
        "e2b-sandbox-id": s.sandbox_id,
        "e2b-sandbox-port": "49983",
        "content-type": "application/json",
        "connect-protocol-version": "1",
    }
    url = f"{URL}/process.Process/List"
    with httpx.Client(timeout=30, trust_env=False) as c:
        check(c.post(url, content=b"{}", headers=hdrs).status_code == 401, "no token accepted")
        bad = c.post(url, content=b"{}", headers={**hdrs, "x-access-token": "wrong"})
        check(bad.status_code == 401, "wrong token accepted")
        ok = c.post(url, content=b"{}", headers={**hdrs, "x-access-token": token})
        check(ok.status_code == 200, f"right token: {ok.status_code}")


def user_servers(r: Run) -> None:
    s: Sandbox = r.state["s"]
    s.files.write("/tmp/guest_server.py", GUEST_SERVER)
    h = s.commands.run(
        f"python3 /tmp/guest_server.py {HTTP_PORT} {WS_PORT}", background=True, timeout=0
    )
    try:
        hdrs = {"e2b-sandbox-id": s.sandbox_id, "e2b-sandbox-port": str(HTTP_PORT)}
        with httpx.Client(base_url=URL, timeout=30, trust_env=False) as c:
            deadline = time.monotonic() + 60
            resp = c.get("/x", headers=hdrs)
            while resp.status_code == 502 and time.monotonic() < deadline:
                time.sleep(0.3)
                resp = c.get("/x", headers=hdrs)
            check(resp.status_code == 200 and "hello from" in resp.text, resp.text)
            host = s.get_host(HTTP_PORT)
            check(host.startswith(f"{HTTP_PORT}-{s.sandbox_id}."), host)
            by_host = c.get("/y", headers={"host": f"{HTTP_PORT}-{s.sandbox_id}.{DOMAIN}"})
            check(by_host.status_code == 200 and "/y" in by_host.text, by_host.text)
        websocket_echo(s)
    finally:
        s.commands.kill(h.pid)


def websocket_echo(s: Sandbox) -> None:
    try:
        from websockets.asyncio.client import connect
    except ImportError:
        return

    async def go() -> None:
        ws_url = URL.replace("http://", "ws://") + "/"
        hdrs = {"e2b-sandbox-id": s.sandbox_id, "e2b-sandbox-port": str(WS_PORT)}
        async with connect(ws_url, additional_headers=hdrs, compression=None) as ws:
            await ws.send("ping through the proxy")
            check(await ws.recv() == "ping through the proxy", "text echo")
            payload = os.urandom(100_000)
            await ws.send(payload)
            check(await ws.recv() == payload, "binary echo")

    asyncio.run(go())


def list_and_kill(r: Run) -> None:
    s: Sandbox = r.state["s"]
    # One more sandbox: with the main one that is two VMs, the most this host should run.
    others = [Sandbox.create(template="base", timeout=300, metadata=LIST_META, request_timeout=300)]
    r.state["others"] = others
    query = SandboxQuery(metadata=LIST_META, state=[SandboxState.RUNNING])
    pager = Sandbox.list(query=query, limit=1)
    seen: list[str] = []
    pages = 0
    while pager.has_next and pages < 10:
        items = pager.next_items()
        pages += 1
        seen += [i.sandbox_id for i in items]
        check(all(i.metadata == dict(i.metadata) for i in items), "metadata")
    expected = {s.sandbox_id, *(o.sandbox_id for o in others)}
    check(set(seen) == expected and len(seen) == 2, f"listed {seen}")
    check(pages == 2, f"{pages} pages")
    paused = Sandbox.list(query=SandboxQuery(state=[SandboxState.PAUSED])).next_items()
    check(paused == [], "paused list not empty")

    victim = others[0]
    check(victim.kill() is True, "kill")
    check(Sandbox.kill(victim.sandbox_id) is False, "second kill")
    raises(e2b_exc.SandboxNotFoundException, lambda: Sandbox.get_info(victim.sandbox_id))
    check(victim.is_running() is False, "is_running after kill")
    not_running = getattr(e2b_exc, "SandboxNotRunningException", e2b_exc.TimeoutException)
    raises(not_running, lambda: victim.commands.run("true"))


def error_hygiene(r: Run) -> None:
    check(Sandbox.kill("inosuchsandbox") is False, "kill unknown")
    raises(e2b_exc.SandboxNotFoundException, lambda: Sandbox.get_info("inosuchsandbox"))
    raises(e2b_exc.SandboxNotFoundException, lambda: Sandbox.set_timeout("inosuchsandbox", 10))
    raises(e2b_exc.SandboxNotFoundException, lambda: Sandbox.connect("inosuchsandbox"))


def metrics(r: Run) -> None:
    s: Sandbox = r.state["s"]
    samples = s.get_metrics()
    check(samples and samples[0].mem_total > 0 and samples[0].cpu_count >= 1, repr(samples))


def set_timeout_expiry(r: Run) -> None:
    s: Sandbox = r.state["s"]
    s.set_timeout(5)
    # Gone once the reaper sees it expired: polled, up to a bound well past the timeout.
    deadline = time.monotonic() + 30
    while s.is_running() and time.monotonic() < deadline:
        time.sleep(0.5)
    raises(e2b_exc.SandboxNotFoundException, lambda: Sandbox.get_info(s.sandbox_id))
    check(s.is_running() is False, "still running after expiry")


LEGS: dict[str, list[tuple[str, Callable[[Run], None]]]] = {
    "latest": [
        ("create_and_info", create_and_info),
        ("run_output", run_output),
        ("env_cwd_user", env_cwd_user),
        ("streaming", streaming),
        ("background_child", background_child),
        ("background_kill", background_kill),
        ("stdin", stdin),
        ("pty", pty),
        ("files", files),
        ("watch", watch),
        ("big_file", big_file),
        ("connect_by_id", connect_by_id),
        ("secure_token", secure_token),
        ("user_servers", user_servers),
        ("metrics", metrics),
        ("list_and_kill", list_and_kill),
        ("error_hygiene", error_hygiene),
        ("set_timeout_expiry", set_timeout_expiry),
    ],
    # e2b 2.50, the last release that creates (POST /sandboxes) and connects
    # (POST /sandboxes/{id}/connect) through the v1 routes; everything but the 100 MB upload.
    "v1": [
        ("create_and_info", create_and_info),
        ("run_output", run_output),
        ("env_cwd_user", env_cwd_user),
        ("streaming", streaming),
        ("background_child", background_child),
        ("background_kill", background_kill),
        ("stdin", stdin),
        ("pty", pty),
        ("files", files),
        ("watch", watch),
        ("connect_by_id", connect_by_id),
        ("secure_token", secure_token),
        ("user_servers", user_servers),
        ("metrics", metrics),
        ("list_and_kill", list_and_kill),
        ("error_hygiene", error_hygiene),
        ("set_timeout_expiry", set_timeout_expiry),
    ],
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--leg", choices=sorted(LEGS), required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    run = Run()
    for name, fn in LEGS[args.leg]:
        if name != "create_and_info" and "s" not in run.state:
            run.results.append({"scenario": name, "ok": False, "error": "no sandbox"})
            continue
        run.scenario(name, lambda fn=fn: fn(run))
    for sbx in [run.state.get("s"), *run.state.get("others", [])]:
        if sbx is not None:
            with contextlib.suppress(Exception):
                sbx.kill()
    timings = {k: v for k, v in run.state.items() if k.endswith("_s")}
    with open(args.out, "w") as fh:
        json.dump({"results": run.results, "timings": timings}, fh, indent=2)


if __name__ == "__main__":
    main()
