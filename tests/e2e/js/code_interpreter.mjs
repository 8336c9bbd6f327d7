// The JS code-interpreter SDK (npm `@e2b/code-interpreter`, pinned with `e2b` in
// package-lock.json) on a `code-interpreter-v1` sandbox (run by
// tests/e2e/test_code_interpreter.py on its module's sandbox): runCode's logs, results and
// errors with their callbacks, envs, a matplotlib chart, contexts (create, list, cwd,
// restart, remove, bash by language) and a run interrupted by its timeout.

import { Sandbox, TimeoutError } from '@e2b/code-interpreter'

import { check, main, rejects } from './lib.mjs'

const RT = { requestTimeoutMs: 120_000 }

async function connect(sandboxId) {
  check(sandboxId, 'no sandbox id given')
  return Sandbox.connect(sandboxId, RT)
}

async function runCode(sandboxId) {
  const sbx = await connect(sandboxId)
  const out = []
  const err = []
  const results = []
  const ex = await sbx.runCode(
    "import sys\njs_x = 20\nprint('out', js_x)\nprint('err', file=sys.stderr)\njs_x * 2 + 2",
    {
      ...RT,
      onStdout: (m) => out.push(m.line),
      onStderr: (m) => err.push(m.line),
      onResult: (r) => results.push(r),
    },
  )
  check(ex.error === undefined, `error: ${JSON.stringify(ex.error)}`)
  check(ex.text === '42', `text ${ex.text}`)
  check(JSON.stringify(ex.logs.stdout) === '["out 20\\n"]', `stdout ${JSON.stringify(ex.logs)}`)
  check(JSON.stringify(ex.logs.stderr) === '["err\\n"]', `stderr ${JSON.stringify(ex.logs)}`)
  check(JSON.stringify(out) === '["out 20\\n"]', `onStdout ${JSON.stringify(out)}`)
  check(JSON.stringify(err) === '["err\\n"]', `onStderr ${JSON.stringify(err)}`)
  check(results.length === 1 && results[0].isMainResult, `onResult ${JSON.stringify(results)}`)
  check(ex.executionCount > 0, `executionCount ${ex.executionCount}`)

  const errors = []
  const bad = await sbx.runCode('1 / 0', { ...RT, onError: (e) => errors.push(e) })
  check(bad.error?.name === 'ZeroDivisionError', `error ${JSON.stringify(bad.error)}`)
  check(bad.error.traceback.includes('ZeroDivisionError'), 'traceback')
  check(errors.length === 1 && errors[0].name === 'ZeroDivisionError', 'onError')

  // A request's env vars, gone after it.
  const env = await sbx.runCode("import os; os.environ.get('JS_CI_VAR')", {
    ...RT,
    envs: { JS_CI_VAR: 'set' },
  })
  check(env.text === 'set', `envs: ${env.text}`)
  const after = await sbx.runCode("import os; os.environ.get('JS_CI_VAR')", RT)
  check(after.text === undefined, `envs after: ${after.text}`)
}

async function chart(sandboxId) {
  const sbx = await connect(sandboxId)
  const ex = await sbx.runCode(
    "import matplotlib.pyplot as plt\nplt.bar(['a', 'b'], [3, 5])\nplt.title('js bars')\nplt.show()",
    RT,
  )
  check(ex.error === undefined, `error ${JSON.stringify(ex.error)}`)
  const fig = ex.results.find((r) => r.png)
  check(fig, `no PNG among ${ex.results.length} results`)
  check(Buffer.from(fig.png, 'base64').subarray(1, 4).toString() === 'PNG', 'PNG magic')
  check(fig.chart?.type === 'bar' && fig.chart.title === 'js bars', `chart ${JSON.stringify(fig.chart)}`)
  check(fig.formats().includes('png'), `formats ${fig.formats()}`)
}

async function contexts(sandboxId) {
  const sbx = await connect(sandboxId)
  const py = await sbx.createCodeContext({ cwd: '/tmp', ...RT })
  check(py.language === 'python' && py.cwd === '/tmp', `context ${JSON.stringify(py)}`)
  const cwd = await sbx.runCode('import os; os.getcwd()', { context: py, ...RT })
  // A quoted text/plain loses its quotes, as upstream's server does.
  check(cwd.text === '/tmp', `cwd ${cwd.text}`)
  await sbx.runCode('ctx_v = 7', { context: py, ...RT })
  // The default context does not see another context's names.
  const other = await sbx.runCode("'ctx_v' in globals()", RT)
  check(other.text === 'False', `isolation ${other.text}`)

  const listed = await sbx.listCodeContexts()
  check(listed.some((c) => c.id === py.id), `list ${JSON.stringify(listed)}`)

  await sbx.restartCodeContext(py)
  const gone = await sbx.runCode("'ctx_v' in globals()", { context: py, ...RT })
  check(gone.text === 'False', `after restart ${gone.text}`)

  // One bash kernel, by language (the default context of a language); a bash context made
  // by id is the Python suite's check (a second kernel start costs ~13 s under TCG).
  const byLang = await sbx.runCode('echo "js $PWD"', { language: 'bash', ...RT })
  check(byLang.logs.stdout.join('') === 'js /home/user\n', `language bash ${JSON.stringify(byLang.logs)}`)

  await sbx.removeCodeContext(py)
  const left = (await sbx.listCodeContexts()).map((c) => c.id)
  check(!left.includes(py.id), `after remove ${JSON.stringify(left)}`)
}

async function interrupt(sandboxId) {
  const sbx = await connect(sandboxId)
  await sbx.runCode('js_kept = 5', RT)
  await rejects(
    TimeoutError,
    () => sbx.runCode('import time; time.sleep(60)', { timeoutMs: 3_000, ...RT }),
    'a run past its timeoutMs',
  )
  // The kernel was interrupted, not lost: the next run sees the earlier state.
  const next = await sbx.runCode('js_kept + 1', RT)
  check(next.text === '6', `after interrupt ${next.text} ${JSON.stringify(next.error)}`)
}

await main({ run_code: runCode, chart, contexts, interrupt })
