// Commands, PTY and files through the E2B JS SDK, on one sandbox shared by the scenarios:
// `create` makes it and prints `SANDBOX_ID=<id>`; the others connect to it by id.

import { createHash, randomBytes } from 'node:crypto'

import {
  CommandExitError,
  FileNotFoundError,
  NotFoundError,
  Sandbox,
  SandboxNotFoundError,
  TimeoutError,
} from 'e2b'

import { CREATE_OPTS, HOME, META, check, connect, guestGet, main, rejects, until } from './lib.mjs'

async function create() {
  const t0 = Date.now()
  const sbx = await Sandbox.create('base', {
    ...CREATE_OPTS,
    timeoutMs: 900_000,
    metadata: META,
    envs: { FOO: 'bar' },
  })
  console.log(`SANDBOX_ID=${sbx.sandboxId}`)
  console.log(`create took ${Date.now() - t0} ms`)
  check(/^i[a-z0-9]+$/.test(sbx.sandboxId), `sandbox id ${sbx.sandboxId}`)
  const info = await sbx.getInfo()
  check(JSON.stringify(info.metadata) === JSON.stringify(META), `metadata ${JSON.stringify(info.metadata)}`)
  check(info.state === 'running', `state ${info.state}`)
  check(info.templateId, 'no templateId')
  const left = (info.endAt.getTime() - Date.now()) / 1000
  check(left > 880 && left <= 901, `endAt is ${left.toFixed(0)} s away`)
  check(await sbx.isRunning(), 'isRunning() is false')
  const res = await sbx.commands.run('echo $FOO; whoami; pwd')
  check(res.stdout === `bar\nuser\n${HOME}\n`, `create envs/user/cwd: ${JSON.stringify(res.stdout)}`)
}

async function streaming(id) {
  const sbx = await connect(id)
  const out = []
  const err = []
  const res = await sbx.commands.run('for i in 1 2 3; do echo $i; echo e$i >&2; sleep 1; done', {
    onStdout: (data) => out.push([Date.now(), data]),
    onStderr: (data) => err.push(data),
  })
  check(res.exitCode === 0, `exit code ${res.exitCode}`)
  check(res.stdout === '1\n2\n3\n', `stdout ${JSON.stringify(res.stdout)}`)
  check(res.stderr === 'e1\ne2\ne3\n', `stderr ${JSON.stringify(res.stderr)}`)
  check(out.map(([, d]) => d).join('') === res.stdout, 'onStdout saw other data than stdout')
  check(err.join('') === res.stderr, 'onStderr saw other data than stderr')
  check(out.length >= 3, `${out.length} stdout callbacks: output was not streamed`)
  check(out[out.length - 1][0] - out[0][0] > 1500, 'output arrived all at once')
  const failed = await rejects(CommandExitError, () => sbx.commands.run('echo x; exit 3'), 'exit 3')
  check(failed.exitCode === 3 && failed.stdout === 'x\n', `exit 3 gave ${failed.exitCode} ${failed.stdout}`)
  const custom = await sbx.commands.run('echo $FOO; pwd', { envs: { FOO: 'baz' }, cwd: '/tmp', user: 'root' })
  check(custom.stdout === 'baz\n/tmp\n', `envs/cwd override: ${JSON.stringify(custom.stdout)}`)
  // A command past its timeoutMs ends the call with the SDK's TimeoutError, promptly.
  const t0 = Date.now()
  await rejects(TimeoutError, () => sbx.commands.run('sleep 30', { timeoutMs: 2_000 }), 'timeoutMs 2000')
  check(Date.now() - t0 < 15_000, `the timed-out command returned after ${Date.now() - t0} ms`)
}

async function backgroundChild(id) {
  const sbx = await connect(id)
  // The shell exits at once; its child keeps running with the command's stdout redirected.
  // The command must end with the shell, not when the child does.
  const t0 = Date.now()
  const res = await sbx.commands.run('python3 -m http.server 8000 >/dev/null 2>&1 & echo started', {
    timeoutMs: 60_000,
  })
  const took = Date.now() - t0
  check(res.stdout === 'started\n' && res.exitCode === 0, `result ${JSON.stringify(res)}`)
  check(took < 15_000, `run took ${took} ms: it waited for the background child`)
  check((await until('http.server answers', 60_000, async () => (await guestGet(sbx, 8000)) === '200')) === true, 'no answer')
  // A background command: its output reaches a second client that connects to it by pid.
  const ticker = await sbx.commands.run('for i in 1 2 3 4 5 6; do echo tick$i; sleep 0.5; done', { background: true })
  const relayed = []
  const attached = await sbx.commands.connect(ticker.pid, { onStdout: (d) => relayed.push(d) })
  const done = await attached.wait()
  check(done.exitCode === 0 && done.stdout.includes('tick6'), `connected command ended ${JSON.stringify(done)}`)
  check(relayed.join('').includes('tick6'), `connect relayed ${JSON.stringify(relayed)}`)
  // A background command through the SDK: listed, killed once, its wait reports the kill.
  const h = await sbx.commands.run('sleep 300', { background: true })
  const pids = (await sbx.commands.list()).map((p) => p.pid)
  check(pids.includes(h.pid), `pid ${h.pid} not in ${pids}`)
  check((await sbx.commands.kill(h.pid)) === true, 'first kill')
  const killed = await rejects(CommandExitError, () => h.wait(), 'wait after kill')
  check(killed.exitCode !== 0, `exit code after kill ${killed.exitCode}`)
  check((await sbx.commands.kill(h.pid)) === false, 'second kill found the process')
}

async function stdin(id) {
  const sbx = await connect(id)
  const h = await sbx.commands.run('cat', { background: true, stdin: true })
  await sbx.commands.sendStdin(h.pid, 'abc\n')
  await h.sendStdin(new TextEncoder().encode('xy'))
  await sbx.commands.closeStdin(h.pid)
  const res = await h.wait()
  check(res.stdout === 'abc\nxy', `cat echoed ${JSON.stringify(res.stdout)}`)
}

async function pty(id) {
  const sbx = await connect(id)
  const chunks = []
  const text = () => Buffer.concat(chunks).toString()
  const term = await sbx.pty.create({ cols: 80, rows: 24, onData: (d) => chunks.push(Buffer.from(d)), timeoutMs: 120_000 })
  const enc = new TextEncoder()
  await sbx.pty.sendInput(term.pid, enc.encode('echo hi-$((40+2))\n'))
  await sbx.pty.resize(term.pid, { cols: 100, rows: 30 })
  await sbx.pty.sendInput(term.pid, enc.encode('stty size\n'))
  // A login shell under emulation takes a few seconds before it reads its input.
  await until('pty output', 60_000, () => text().includes('hi-42') && text().includes('30 100'))
  check((await sbx.pty.kill(term.pid)) === true, 'pty kill')
  const end = await rejects(CommandExitError, () => term.wait(), 'pty wait after kill')
  check(end.exitCode !== 0, `pty exit ${end.exitCode}`)
}

async function files(id) {
  const sbx = await connect(id)
  const fs = sbx.files
  const info = await fs.write(`${HOME}/a.txt`, 'hello')
  check(info.name === 'a.txt' && info.path === `${HOME}/a.txt`, `write info ${JSON.stringify(info)}`)
  await fs.write([
    { path: `${HOME}/d/b.txt`, data: 'bee' },
    { path: `${HOME}/d/c.bin`, data: new Uint8Array([0, 1, 255]).buffer },
  ])
  check((await fs.read(`${HOME}/a.txt`)) === 'hello', 'read text')
  const bytes = await fs.read(`${HOME}/d/c.bin`, { format: 'bytes' })
  check(Buffer.from(bytes).equals(Buffer.from([0, 1, 255])), `read bytes ${Buffer.from(bytes).toString('hex')}`)
  // A few MiB, both ways, compared by digest.
  const big = randomBytes(4 << 20)
  await fs.write(`${HOME}/big.bin`, new Blob([big]))
  const back = Buffer.from(await fs.read(`${HOME}/big.bin`, { format: 'bytes' }))
  const digest = (b) => createHash('sha256').update(b).digest('hex')
  check(digest(back) === digest(big), `4 MiB round trip differs (${back.length} bytes back)`)
  const streamed = createHash('sha256')
  for await (const chunk of await fs.read(`${HOME}/big.bin`, { format: 'stream' })) streamed.update(chunk)
  check(streamed.digest('hex') === digest(big), 'streamed read differs')
  const guest = (await sbx.commands.run(`sha256sum ${HOME}/big.bin`)).stdout.split(' ')[0]
  check(guest === digest(big), 'guest-side sha256 differs')
  check((await fs.exists(`${HOME}/a.txt`)) && !(await fs.exists('/missing')), 'exists')
  const entry = await fs.getInfo(`${HOME}/a.txt`)
  check(entry.size === 5 && entry.type === 'file' && entry.permissions && entry.modifiedTime, `getInfo ${JSON.stringify(entry)}`)
  const top = (await fs.list(HOME)).map((e) => e.path)
  check(top.includes(`${HOME}/a.txt`) && top.includes(`${HOME}/d`) && !top.includes(`${HOME}/d/b.txt`), `list ${top}`)
  const deep = (await fs.list(HOME, { depth: 2 })).map((e) => e.path)
  check(deep.includes(`${HOME}/d/b.txt`) && deep.includes(`${HOME}/d/c.bin`), `list depth 2 ${deep}`)
  check((await fs.makeDir(`${HOME}/nd/x`)) === true, 'makeDir new')
  check((await fs.makeDir(`${HOME}/nd/x`)) === false, 'makeDir existing')
  const moved = await fs.rename(`${HOME}/a.txt`, `${HOME}/a2.txt`)
  check(moved.path === `${HOME}/a2.txt`, `rename gave ${moved.path}`)
  check((await fs.exists(`${HOME}/a2.txt`)) && !(await fs.exists(`${HOME}/a.txt`)), 'rename')
  await fs.remove(`${HOME}/a2.txt`)
  await fs.remove(`${HOME}/d`)
  await fs.remove(`${HOME}/big.bin`)
  check(!(await fs.exists(`${HOME}/a2.txt`)) && !(await fs.exists(`${HOME}/d`)), 'remove')
  // Data from a ReadableStream (sent as it is read).
  const parts = ['str', 'eam']
  const stream = new ReadableStream({
    pull(ctl) {
      const next = parts.shift()
      if (next === undefined) ctl.close()
      else ctl.enqueue(new TextEncoder().encode(next))
    },
  })
  await fs.write(`${HOME}/s.txt`, stream)
  check((await fs.read(`${HOME}/s.txt`)) === 'stream', 'write from a ReadableStream')
  await fs.remove(`${HOME}/s.txt`)
  await rejects(FileNotFoundError, () => fs.read('/nope'), 'read of a missing file')
  await rejects(FileNotFoundError, () => fs.list('/nope'), 'list of a missing directory')
}

async function watch(id) {
  const sbx = await connect(id)
  await sbx.files.makeDir(`${HOME}/w/sub`)
  const events = []
  const handle = await sbx.files.watchDir(`${HOME}/w`, (ev) => events.push(ev), { recursive: true, timeoutMs: 0 })
  try {
    await sbx.files.write(`${HOME}/w/new.txt`, 'x')
    await sbx.files.write(`${HOME}/w/sub/deep.txt`, 'y')
    await sbx.files.remove(`${HOME}/w/new.txt`)
    const seen = () => events.map((e) => `${e.type}:${e.name}`)
    await until('watch events', 30_000, () => {
      const s = seen()
      return s.some((e) => /^(create|write):new\.txt$/.test(e)) && s.includes('remove:new.txt') && s.some((e) => e.endsWith('deep.txt'))
    })
  } finally {
    await handle.stop()
  }
  await sbx.files.remove(`${HOME}/w`)
}

async function listMetadata(id) {
  const found = []
  const pager = Sandbox.list({ query: { metadata: META, state: ['running'] }, limit: 1 })
  for (let pages = 0; pager.hasNext && pages < 10; pages++) found.push(...(await pager.nextItems()))
  const mine = found.find((s) => s.sandboxId === id)
  check(mine, `sandbox ${id} not listed by its metadata: ${found.map((s) => s.sandboxId)}`)
  check(JSON.stringify(mine.metadata) === JSON.stringify(META), `listed metadata ${JSON.stringify(mine.metadata)}`)
  check(mine.state === 'running', `listed state ${mine.state}`)
  const other = await Sandbox.list({ query: { metadata: { ...META, run: 'another run' } } }).nextItems()
  check(other.length === 0, `a metadata filter that matches nothing listed ${other.map((s) => s.sandboxId)}`)
  const paused = await Sandbox.list({ query: { metadata: META, state: ['paused'] } }).nextItems()
  check(!paused.some((s) => s.sandboxId === id), 'a running sandbox listed as paused')
}

async function connectById(id) {
  const sbx = await Sandbox.connect(id, { timeoutMs: 900_000 })
  check(sbx.sandboxId === id, `connected to ${sbx.sandboxId}`)
  check((await sbx.commands.run('echo again')).stdout === 'again\n', 'command after connect')
  const again = await sbx.connect()
  check((await again.files.exists(HOME)) === true, 'instance connect()')
  const info = await Sandbox.getInfo(id)
  check(info.endAt.getTime() - Date.now() > 880_000, `connect with timeoutMs did not extend endAt (${info.endAt.toISOString()})`)
  const metrics = await sbx.getMetrics()
  check(metrics.length > 0 && metrics[0].cpuCount >= 1 && metrics[0].memTotal > 0, `metrics ${JSON.stringify(metrics)}`)
  await rejects(NotFoundError, () => Sandbox.connect('inosuchsandbox'), 'connect to an unknown id')
  await rejects(SandboxNotFoundError, () => Sandbox.getInfo('inosuchsandbox'), 'getInfo of an unknown id')
  check((await Sandbox.kill('inosuchsandbox')) === false, 'kill of an unknown id')
}

await main({
  create,
  streaming,
  background_child: backgroundChild,
  stdin,
  pty,
  files,
  watch,
  list_metadata: listMetadata,
  connect: connectById,
})
