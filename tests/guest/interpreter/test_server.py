"""The code-interpreter server (guest port 49999), run as the guest runs it, without a VM.

One server per module: a subprocess of the dev venv's python started as
`python -m interpreter` from src/agentenv/guest (the standalone package the template copies),
with real ipykernel/bash_kernel kernels and a fake envd on loopback for `GET /envs`. Every stream
is parsed with the official SDK's own `parse_output`/`Execution`/`Context`, so a field the SDK
could not read fails here.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from e2b import ConnectionConfig, NotFoundException, TimeoutException
from e2b_code_interpreter import Sandbox
from e2b_code_interpreter.charts import ChartType
from e2b_code_interpreter.models import Context, Execution, parse_output

from ..wakeups import wakeups_per_s

PACKAGE_PARENT = Path(__file__).parents[3] / "src" / "agentenv" / "guest"
TOKEN = "token-123"
SANDBOX_ENVS = {"SANDBOX_VAR": "from-envd", "SHARED": "sandbox-value"}


class FakeEnvd(BaseHTTPRequestHandler):
    """envd's `GET /envs`; remembers the access tokens it was asked with."""

    tokens: list[str | None] = []

    def do_GET(self) -> None:
        FakeEnvd.tokens.append(self.headers.get("X-Access-Token"))
        body = json.dumps(SANDBOX_ENVS).encode()
        self.send_response(200 if self.path == "/envs" else 404)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("interpreter")


@contextlib.contextmanager
def serve(
    workdir: Path, name: str, args: list[str]
) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """`python -m interpreter` on a free loopback port, as the guest runs it; stopped after."""
    port = _free_port()
    log = (workdir / f"{name}.log").open("wb")
    tmp = workdir / f"{name}-tmp"
    tmp.mkdir()
    env = dict(os.environ, PYTHONPATH="", SHARED="kernel-start-value", TMPDIR=str(tmp))
    env.pop("SANDBOX_VAR", None)
    command = [sys.executable, "-m", "interpreter", "--host", "127.0.0.1", "--port", str(port)]
    proc = subprocess.Popen(
        command + args,
        cwd=PACKAGE_PARENT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        yield proc, f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        log.close()
    # A clean stop leaves nothing: kernels shut down, their runtime dir removed.
    assert list(tmp.iterdir()) == []


def wait_health(proc: subprocess.Popen[bytes], url: str, want: int) -> httpx.Response:
    """Poll `/health` until it answers `want` (90 s deadline)."""
    deadline = time.monotonic() + 90
    while True:
        assert proc.poll() is None, f"server exited {proc.returncode}"
        try:
            response = httpx.get(f"{url}/health", timeout=5)
            if response.status_code == want:
                return response
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, f"/health did not answer {want} in 90 s"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def server(workdir: Path) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    envd = ThreadingHTTPServer(("127.0.0.1", 0), FakeEnvd)
    threading.Thread(target=envd.serve_forever, daemon=True).start()
    home = workdir / "home"
    home.mkdir()
    args = ["--envd-url", f"http://127.0.0.1:{envd.server_address[1]}", "--cwd", str(home)]
    args += ["--keepalive", "0.5", "--start-timeout", "60"]
    try:
        with serve(workdir, "server", args) as (proc, url):
            wait_health(proc, url, 200)
            yield proc, url
    finally:
        envd.shutdown()


@pytest.fixture(scope="module")
def base_url(server: tuple[subprocess.Popen[bytes], str]) -> str:
    return server[1]


def test_an_idle_server_wakes_about_once_a_second(
    server: tuple[subprocess.Popen[bytes], str],
) -> None:
    """Its loop is `quiet_server`'s: under TCG each wakeup of an idle sandbox's server costs
    its host CPU. Its default python kernel is another process, not counted."""
    proc, url = server
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200
    time.sleep(0.5)
    woke = wakeups_per_s(proc.pid)
    # With uvicorn's own loop: >10/s.
    assert woke < 4, f"{woke:.1f} wakeups/s"


def test_warm_up_leaves_no_trace(base_url: str, workdir: Path) -> None:
    """The server ran a cell in its python kernel before its /health said 200 (so that a
    template's snapshot has it done, `Kernel.warm_up`): the first execution a client makes
    is still number 1, `_` is a fresh kernel's, the warm-up's env var is gone. Runs first."""
    ex = run(base_url, "import os\n(_, os.environ.get('AGENTENV_WARM_UP'))")
    assert ex.execution_count == 1
    assert ex.text == "('', None)"
    assert "warm-up" not in (workdir / "server.log").read_text()


def test_health_reports_failed_defaults(workdir: Path) -> None:
    # A default language with no kernel: /health never says 200 and tells why; work is refused.
    with serve(workdir, "bad-defaults", ["--default-languages", "cobol"]) as (proc, url):
        deadline = time.monotonic() + 60
        response = wait_health(proc, url, 503)
        while "cobol" not in response.json()["message"]:
            assert time.monotonic() < deadline, response.json()
            response = wait_health(proc, url, 503)
        refused = httpx.post(f"{url}/execute", json={"code": "1"}, timeout=30)
        assert refused.status_code == 503 and "cobol" in refused.json()["message"]


def run(
    url: str,
    code: str,
    *,
    context_id: str | None = None,
    language: str | None = None,
    env_vars: dict[str, str] | None = None,
    lines: list[dict[str, Any]] | None = None,
) -> Execution:
    """`POST /execute` as the SDK sends it, parsed with the SDK's own parser."""
    execution = Execution()
    body = {"code": code, "context_id": context_id, "language": language, "env_vars": env_vars}
    with httpx.stream(
        "POST", f"{url}/execute", json=body, headers={"X-Access-Token": TOKEN}, timeout=60
    ) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if lines is not None:
                lines.append(json.loads(line))
            parse_output(execution, line)
    return execution


def test_output_result_and_count(base_url: str) -> None:
    lines: list[dict[str, Any]] = []
    ex = run(
        base_url, "import sys\nprint('out')\nprint('err', file=sys.stderr)\n1 + 1", lines=lines
    )
    assert ex.logs.stdout == ["out\n"]
    assert ex.logs.stderr == ["err\n"]
    assert ex.text == "2"
    assert ex.error is None
    assert isinstance(ex.execution_count, int) and ex.execution_count >= 1
    assert lines[-1] == {"type": "end_of_execution"}
    assert all(isinstance(x.get("timestamp"), str) for x in lines if x["type"] == "stdout")
    # A str result loses its quotes, as upstream's server strips them.
    assert run(base_url, "'abc'").text == "abc"


def test_error_with_traceback(base_url: str) -> None:
    ex = run(base_url, "undefined_name_xyz")
    assert ex.error is not None
    assert ex.error.name == "NameError"
    assert "undefined_name_xyz" in ex.error.value
    assert "NameError" in ex.error.traceback and "\x1b[" not in ex.error.traceback
    assert ex.results == []


def test_env_vars_applied_then_restored(base_url: str) -> None:
    code = (
        "import os\n(os.environ.get('SANDBOX_VAR'), os.environ.get('SHARED'), os.environ.get('X'))"
    )
    ex = run(base_url, code, env_vars={"X": "it's $x", "SHARED": "request"})
    assert ex.text == "('from-envd', 'request', \"it's $x\")"
    assert TOKEN in FakeEnvd.tokens
    # After the request: X unset, SHARED back to the sandbox's value (envd), not the request's.
    assert run(base_url, code).text == "('from-envd', 'sandbox-value', None)"


def test_matplotlib_chart_and_png(base_url: str) -> None:
    ex = run(
        base_url,
        "import matplotlib.pyplot as plt\n"
        "plt.plot([1, 2, 3], [1, 4, 9])\nplt.title('squares')\nplt.show()\n"
        "fig = plt.figure()\nplt.bar(['a', 'b'], [3, 5])\nfig",
    )
    assert ex.error is None, ex.error
    shown = [r for r in ex.results if r.chart is not None and r.chart.type == ChartType.LINE]
    assert len(shown) == 1 and shown[0].png and not shown[0].is_main_result
    assert shown[0].chart is not None and shown[0].chart.title == "squares"
    main = [r for r in ex.results if r.is_main_result]
    assert len(main) == 1 and main[0].png
    assert main[0].chart is not None and main[0].chart.type == ChartType.BAR


def test_chart_kinds(base_url: str) -> None:
    ex = run(
        base_url,
        "import matplotlib.pyplot as plt\n"
        "plt.scatter([1, 2, 3], [3, 1, 2]); plt.show()\n"
        "plt.pie([1, 2, 3], labels=['a', 'b', 'c']); plt.show()\n"
        "plt.boxplot([[85, 90, 78, 92], [95, 89, 76, 91, 84]], tick_labels=['a', 'b'],\n"
        "            patch_artist=True)\n"
        "plt.show()\n"
        "fig, (a, b) = plt.subplots(1, 2); a.plot([1, 2], [2, 1]); b.bar(['x'], [1]); plt.show()",
    )
    assert ex.error is None, ex.error
    kinds = [r.chart.type for r in ex.results if r.chart is not None]
    assert kinds == [
        ChartType.SCATTER,
        ChartType.PIE,
        ChartType.BOX_AND_WHISKER,
        ChartType.SUPERCHART,
    ]
    assert all(r.png for r in ex.results)


def test_dataframe_result(base_url: str) -> None:
    ex = run(
        base_url,
        "import pandas as pd\n"
        "pd.DataFrame({'a': [1, 2], 't': pd.to_datetime(['2026-01-01', '2026-01-02'])})",
    )
    assert ex.error is None, ex.error
    main = ex.results[0]
    assert main.is_main_result and main.html and "<table" in main.html
    assert main.data == {"a": [1, 2], "t": ["2026-01-01T00:00:00", "2026-01-02T00:00:00"]}


def test_contexts_cwd_bash_restart_delete(base_url: str, workdir: Path) -> None:
    cwd = workdir / "ctx"
    cwd.mkdir()
    created = httpx.post(f"{base_url}/contexts", json={"cwd": str(cwd)}, timeout=60)
    assert created.status_code == 200, created.text
    ctx = Context.from_json(created.json())
    assert (ctx.language, ctx.cwd) == ("python", str(cwd))
    listed = [Context.from_json(c) for c in httpx.get(f"{base_url}/contexts").json()]
    assert ctx.id in {c.id for c in listed}
    assert run(base_url, "import os\nos.getcwd()", context_id=ctx.id).text == str(cwd)
    # State lives per context.
    run(base_url, "kept = 41", context_id=ctx.id)
    assert run(base_url, "kept + 1", context_id=ctx.id).text == "42"
    assert run(base_url, "kept").error is not None
    # Restart: same id, fresh state, same cwd.
    assert httpx.post(f"{base_url}/contexts/{ctx.id}/restart", timeout=60).status_code == 200
    assert run(base_url, "kept", context_id=ctx.id).error is not None
    assert run(base_url, "import os\nos.getcwd()", context_id=ctx.id).text == str(cwd)
    # Delete: gone from the list, execute there is a 404.
    assert httpx.delete(f"{base_url}/contexts/{ctx.id}", timeout=60).status_code == 200
    assert ctx.id not in {c["id"] for c in httpx.get(f"{base_url}/contexts").json()}
    gone = httpx.post(f"{base_url}/execute", json={"code": "1", "context_id": ctx.id})
    assert gone.status_code == 404 and ctx.id in gone.json()["message"]

    bash = run(base_url, "echo hi-$X; pwd", language="bash", env_vars={"X": "a b"})
    assert bash.logs.stdout and "".join(bash.logs.stdout).split() == [
        "hi-a",
        "b",
        str(workdir / "home"),
    ]
    assert "".join(run(base_url, "echo [$X]", language="bash").logs.stdout).strip() == "[]"


@pytest.mark.parametrize(
    ("path", "body", "status"),
    [
        ("/execute", {"code": "1", "context_id": "x", "language": "python"}, 400),
        ("/execute", {"code": "1", "context_id": "no-such-context"}, 404),
        ("/execute", {"code": "1", "language": "cobol"}, 400),
        ("/execute", {"code": 1}, 400),
        ("/execute", {"code": "1", "env_vars": {"BAD-NAME": "1"}}, 400),
        ("/contexts", {"language": "cobol"}, 400),
        ("/contexts", {"cwd": "/no/such/dir"}, 400),
    ],
)
def test_bad_requests(base_url: str, path: str, body: dict[str, Any], status: int) -> None:
    response = httpx.post(f"{base_url}{path}", json=body, timeout=30)
    assert response.status_code == status
    assert response.json()["code"] == status and response.json()["message"]


def test_unknown_context_routes(base_url: str) -> None:
    for response in (
        httpx.delete(f"{base_url}/contexts/nope"),
        httpx.post(f"{base_url}/contexts/nope/restart"),
    ):
        assert response.status_code == 404 and response.json()["code"] == 404


def test_one_execution_at_a_time(base_url: str, workdir: Path) -> None:
    flag = workdir / "go"
    done: list[str] = []
    first_started = threading.Event()

    def first() -> None:
        code = (
            "import os, time\nprint('first-start', flush=True)\n"
            f"while not os.path.exists({str(flag)!r}):\n    time.sleep(0.05)\n'first'"
        )
        with httpx.stream(
            "POST", f"{base_url}/execute", json={"code": code}, timeout=60
        ) as response:
            ex = Execution()
            for line in response.iter_lines():
                if '"first-start' in line:
                    first_started.set()
                parse_output(ex, line)
        done.append(ex.text or "")

    thread = threading.Thread(target=first)
    thread.start()
    assert first_started.wait(60)
    second: list[str] = []
    other = threading.Thread(target=lambda: second.append(run(base_url, "'second'").text or ""))
    other.start()
    flag.touch()
    thread.join(60)
    other.join(60)
    assert done == ["first"] and second == ["second"]


def test_keepalive_during_silence(base_url: str) -> None:
    lines: list[dict[str, Any]] = []
    ex = run(base_url, "import time\ntime.sleep(1.5)\n'awake'", lines=lines)
    assert ex.text == "awake"
    assert {"type": "keepalive"} in lines


def test_disconnect_interrupts_kernel(base_url: str) -> None:
    code = "import time\nprint('sleeping', flush=True)\ntime.sleep(600)"
    with httpx.stream("POST", f"{base_url}/execute", json={"code": code}, timeout=60) as resp:
        for line in resp.iter_lines():
            if "sleeping" in line:
                break
    # Without the interrupt this would wait for the 600 s sleep and time out.
    assert run(base_url, "'next'").text == "next"


def test_dead_kernel_is_replaced(base_url: str) -> None:
    created = httpx.post(f"{base_url}/contexts", json={}, timeout=60).json()
    ex = run(base_url, "import os\nos._exit(1)", context_id=created["id"])
    assert ex.error is not None and ex.error.name == "ContextRestarting"
    assert run(base_url, "'alive'", context_id=created["id"]).text == "alive"
    httpx.delete(f"{base_url}/contexts/{created['id']}", timeout=60)


class LocalSandbox(Sandbox):
    """The SDK's own `Sandbox` (its transport, parsing and errors) aimed at the local server.

    Only the URL is ours; the SDK's private fields are set as its constructor would (no control
    plane needed). Pinned to e2b 2.63 / e2b-code-interpreter 2.11.5 (pyproject dev extras).
    """

    url = ""

    @property
    def _jupyter_url(self) -> str:
        return self.url

    @classmethod
    def at(cls, url: str) -> LocalSandbox:
        sandbox = object.__new__(cls)
        sandbox.url = url
        sandbox._SandboxBase__sandbox_id = "local"  # type: ignore[attr-defined]
        sandbox._SandboxBase__envd_access_token = TOKEN  # type: ignore[attr-defined]
        sandbox._SandboxBase__traffic_access_token = None  # type: ignore[attr-defined]
        sandbox._SandboxBase__connection_config = ConnectionConfig(  # type: ignore[attr-defined]
            api_key="unused", request_timeout=60
        )
        return sandbox


def test_official_sdk_calls(base_url: str, workdir: Path) -> None:
    sbx = LocalSandbox.at(base_url)
    seen: list[str] = []
    ex = sbx.run_code("print('via sdk')\n6 * 7", on_stdout=lambda m: seen.append(m.line))
    assert ex.text == "42" and seen == ["via sdk\n"]
    ex = sbx.run_code("import os; os.environ['E']", envs={"E": "v"})
    assert ex.text == "v"
    # The SDK's timeout drops the connection; the server interrupts, the next run goes through.
    with pytest.raises(TimeoutException):
        sbx.run_code("while True: pass", timeout=1)
    assert sbx.run_code("'after timeout'").text == "after timeout"

    cwd = workdir / "sdk-ctx"
    cwd.mkdir()
    ctx = sbx.create_code_context(cwd=str(cwd))
    assert (ctx.language, ctx.cwd) == ("python", str(cwd))
    assert ctx.id in {c.id for c in sbx.list_code_contexts()}
    assert sbx.run_code("import os; os.getcwd()", context=ctx).text == str(cwd)
    sbx.restart_code_context(ctx)
    sbx.remove_code_context(ctx)
    with pytest.raises(NotFoundException):
        sbx.run_code("1", context=ctx)
