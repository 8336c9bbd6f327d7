"""The `code-interpreter-v1` template on real microVMs, through the official
`e2b-code-interpreter` SDK, offline.

One server on a fresh (seeded) data dir that has never built the template: the first create,
by the alias `code-interpreter`, is answered 503 + Retry-After while the node builds it
(`node.ondemand`: the image from `base`'s, which `scripts/test` may have built ahead, then the
template snapshot with the python kernel running), and succeeds once it is built. Then one
sandbox carries the SDK checks, its state is kept across pause/resume and by fork children;
the JS SDK (npm `@e2b/code-interpreter`, tests/e2e/js/code_interpreter.mjs) runs its scenarios
on that sandbox, and a smolagents CodeAgent (E2BExecutor, a scripted model) makes one more
sandbox on the same server.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from api.conftest import REQUEST_TIMEOUT_S, stop_and_check, use_sdk_env
from e2b import TimeoutException
from e2b_code_interpreter import Sandbox
from jsrun import JsEnv, js_workdir, node
from smolagents import ChatMessage, CodeAgent, MessageRole, Model

from agentenv.api.devserver import ServerProcess
from agentenv.template.datadir import prepare_home

pytestmark = pytest.mark.vm

# A first-use build: wheels (cached), the image (~1 min), the snapshot (a TCG boot with the
# kernel starting, ~1 min). Polled, bounded.
BUILD_LIMIT_S = 600
RT = 120  # request timeout of SDK calls: a run_code under TCG takes seconds, not minutes


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    home = prepare_home(tmp_path_factory.mktemp("ci-home"))
    srv = ServerProcess(home, ready_timeout_s=180).start()
    restore_env = use_sdk_env(srv)
    try:
        yield srv
    finally:
        restore_env()
        stop_and_check(srv)


@pytest.fixture(scope="module")
def api(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(
        base_url=server.url, headers={"X-API-Key": server.api_key}, timeout=REQUEST_TIMEOUT_S
    ) as client:
        yield client


@pytest.fixture(scope="module")
def sbx(server: ServerProcess, api: httpx.Client) -> Iterator[Sandbox]:
    """A sandbox made through the first-use path: 503 + Retry-After until built, then 201."""
    deadline = time.monotonic() + BUILD_LIMIT_S
    answers: list[int] = []
    while True:
        resp = api.post("/sandboxes", json={"templateID": "code-interpreter", "timeout": 900})
        answers.append(resp.status_code)
        if resp.status_code != 503 or time.monotonic() > deadline:
            break
        assert "first use" in resp.json()["message"], resp.text
        assert int(resp.headers["Retry-After"]) > 0
        time.sleep(2)
    assert resp.status_code == 201, (answers, resp.text, server.log_tail(40))
    assert answers[0] == 503, "the template was there before its first use"
    sandbox = Sandbox.connect(resp.json()["sandboxID"], request_timeout=RT)
    try:
        yield sandbox
    finally:
        sandbox.kill()


def test_the_sdk_creates_by_its_default_template_and_runs_code(
    sbx: Sandbox, server: ServerProcess
) -> None:
    # Built now: the SDK's own create (template code-interpreter-v1) is a plain resume.
    other = Sandbox.create(timeout=300, request_timeout=RT)
    try:
        assert other.run_code("6 * 7", request_timeout=RT).text == "42"
    finally:
        other.kill()

    seen: list[str] = []
    ex = sbx.run_code(
        "import sys\nx = 41\nprint('out', x)\nprint('err', file=sys.stderr)\nx + 1",
        on_stdout=lambda m: seen.append(m.line),
        request_timeout=RT,
    )
    assert ex.error is None, ex.error
    assert ex.text == "42"
    assert ex.logs.stdout == ["out 41\n"] and ex.logs.stderr == ["err\n"]
    assert seen == ["out 41\n"]

    ex = sbx.run_code("1 / 0", request_timeout=RT)
    assert ex.error is not None and ex.error.name == "ZeroDivisionError"
    assert "ZeroDivisionError" in ex.error.traceback

    # The sandbox's env vars and a request's own, restored after it.
    ex = sbx.run_code("import os; os.environ.get('CI_VAR')", envs={"CI_VAR": "set"})
    assert ex.text == "set"
    assert sbx.run_code("import os; os.environ.get('CI_VAR')").text is None


def test_charts_tables_and_packages_come_from_the_template(sbx: Sandbox) -> None:
    ex = sbx.run_code(
        "import matplotlib.pyplot as plt\n"
        "plt.plot([1, 2, 3], [1, 4, 9], label='sq')\nplt.title('squares')\nplt.show()",
        request_timeout=RT,
    )
    assert ex.error is None, ex.error
    figures = [r for r in ex.results if r.png]
    assert figures, ex.results
    chart: Any = figures[0].chart
    assert chart is not None and chart.type.value == "line" and chart.title == "squares"
    ex = sbx.run_code(
        "import pandas as pd, numpy as np\npd.DataFrame({'a': np.arange(3)})", request_timeout=RT
    )
    assert ex.error is None and ex.results and ex.results[0].is_main_result
    assert ex.results[0].data is not None or ex.results[0].html, ex.results[0]


def test_contexts_bash_and_an_interrupted_run(sbx: Sandbox) -> None:
    ctx = sbx.create_code_context(language="bash", cwd="/tmp", request_timeout=RT)
    ex = sbx.run_code("echo hi from $PWD", context=ctx, request_timeout=RT)
    assert ex.logs.stdout == ["hi from /tmp\n"], ex
    assert ctx.id in {c.id for c in sbx.list_code_contexts()}
    sbx.remove_code_context(ctx)
    assert ctx.id not in {c.id for c in sbx.list_code_contexts()}

    with pytest.raises(TimeoutException):
        sbx.run_code("import time; time.sleep(60)", timeout=3, request_timeout=RT)
    # The interrupted kernel runs the next cell, its state intact.
    assert sbx.run_code("x", request_timeout=RT).text == "41"


def test_kernel_state_survives_pause_and_fork(sbx: Sandbox, api: httpx.Client) -> None:
    sbx.run_code("state = [1, 2, 3]", request_timeout=RT)
    assert sbx.beta_pause(request_timeout=RT)
    back = Sandbox.connect(sbx.sandbox_id, request_timeout=RT)
    assert back.run_code("sum(state)", request_timeout=RT).text == "6"

    # Four children (the count): each has the parent's kernel state and diverges on
    # its own; the parent keeps its own.
    resp = api.post(f"/sandboxes/{sbx.sandbox_id}/fork", json={"count": 4})
    assert resp.status_code == 201, resp.text
    kids = [Sandbox.connect(k["sandbox"]["sandboxID"], request_timeout=RT) for k in resp.json()]
    try:
        assert len(kids) == 4
        for i, kid in enumerate(kids):
            kid.run_code(f"state.append({10 * (i + 1)})", request_timeout=RT)
        for i, kid in enumerate(kids):
            assert kid.run_code("sum(state)", request_timeout=RT).text == str(6 + 10 * (i + 1))
        assert back.run_code("sum(state)", request_timeout=RT).text == "6"
    finally:
        for kid in kids:
            kid.kill()


class ScriptedModel(Model):  # type: ignore[misc]
    """A model with no LLM behind it: it answers each step with the next scripted action and
    records the messages it was shown."""

    def __init__(self, actions: list[str]) -> None:
        super().__init__(model_id="scripted")
        self.actions = list(actions)
        self.seen: list[str] = []

    def generate(self, messages: list[Any], **kwargs: Any) -> ChatMessage:
        self.seen.append(str(messages[-1].content if messages else ""))
        code = self.actions.pop(0)
        return ChatMessage(
            role=MessageRole.ASSISTANT, content=f"Thought: next.\n<code>\n{code}\n</code>"
        )


def test_a_smolagents_codeagent_keeps_state_between_steps(sbx: Sandbox) -> None:
    # The executor makes its own sandbox by the SDK's default template (built by `sbx`) and
    # reaches the server through the env vars use_sdk_env set. numpy is an authorized import:
    # E2BExecutor runs `!pip install numpy` at start; the guest has no pip, so the shell says
    # so and the cell succeeds: nothing is installed, numpy is the template's.
    model = ScriptedModel(
        [
            "import numpy as np\nbase = int(np.arange(5).sum())\nprint('base is', base)",
            "total = base * 4 + 2\nprint('total is', total)",
            "final_answer(total)",
        ]
    )
    agent = CodeAgent(
        tools=[],
        model=model,
        executor_type="e2b",
        executor_kwargs={"timeout": 300, "request_timeout": RT},
        additional_authorized_imports=["numpy"],
        max_steps=5,
    )
    try:
        answer = agent.run("Compute 42 the long way.")
    finally:
        agent.python_executor.cleanup()
    assert answer == 42
    assert model.actions == [], "the agent stopped before its final answer"
    # Each step's observation (the sandbox's stdout) reached the model for the next step.
    joined = "\n".join(model.seen)
    assert "base is 10" in joined and "total is 42" in joined, joined


@pytest.fixture(scope="module")
def js(server: ServerProcess, tmp_path_factory: pytest.TempPathFactory) -> JsEnv:
    return JsEnv(server, js_workdir(tmp_path_factory.mktemp("ci-js")), uuid.uuid4().hex[:12])


@pytest.mark.parametrize("scenario", ["run_code", "chart", "contexts", "interrupt"])
def test_the_js_sdk_on_the_same_sandbox(js: JsEnv, sbx: Sandbox, scenario: str) -> None:
    # npm `@e2b/code-interpreter` (tests/e2e/js/code_interpreter.mjs), in its own node process.
    node(js, "code_interpreter.mjs", scenario, sbx.sandbox_id)
