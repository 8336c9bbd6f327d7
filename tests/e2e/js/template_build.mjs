// Template builds through the E2B JS SDK (run by tests/e2e/test_js_template_build.py):
// `build <context>` builds `jsapp` from `base` (COPY of a directory and of a file with a mode,
// ENV, WORKDIR, RUN, a start command with waitForPort) and creates sandboxes from it;
// `background` builds with buildInBackground and polls getBuildStatus; `failing` is a RUN
// step that exits 3; `image <context> <registry host>` builds from a busybox image on a
// loopback registry.

import http from 'node:http'

import { BuildError, Sandbox, Template, waitForPort } from 'e2b'

import { CREATE_OPTS, check, guestGet, main, rejects, sleep } from './lib.mjs'

const SHAPE = { cpuCount: 1, memoryMB: 512 }
const UUID = /^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$/
const BUILD_LIMIT_MS = 300_000

// The line of the caller of this function in this file (to match the SDK's stack traces).
function callerLine() {
  const frame = new Error().stack.split('\n')[2]
  return Number(/:(\d+):\d+\)?$/.exec(frame)[1])
}

// GET through the server's proxy by the sandbox's host name (`sbx.getHost(port)`), as a
// client behind wildcard DNS would: sent to the server on loopback with that Host header.
function hostGet(sbx, port, path) {
  const api = new URL(process.env.E2B_API_URL)
  return new Promise((resolve, reject) => {
    const req = http.request(
      { host: api.hostname, port: api.port, path, headers: { host: sbx.getHost(port) }, timeout: 30_000 },
      (res) => {
        let body = ''
        res.setEncoding('utf8')
        res.on('data', (d) => (body += d))
        res.on('end', () => resolve({ status: res.statusCode, body }))
      }
    )
    req.on('timeout', () => req.destroy(new Error(`GET ${path} on port ${port}: no answer in 30 s`)))
    req.on('error', reject)
    req.end()
  })
}

function jsapp(ctx) {
  return Template({ fileContextPath: ctx })
    .fromTemplate('base')
    .copy('app', '/app')
    .copy('run.sh', '/app/bin/', { mode: 0o755 })
    .setEnvs({ GREETING: 'hello js' })
    .setWorkdir('/app')
    .runCmd('echo "$GREETING from the js build" && ./bin/run.sh > built.txt && echo "$GREETING" >> built.txt')
    .setStartCmd('python3 -m http.server 8080', waitForPort(8080))
}

async function createAndCheck(label) {
  const t0 = Date.now()
  const sbx = await Sandbox.create('jsapp', { ...CREATE_OPTS, timeoutMs: 300_000 })
  const took = Date.now() - t0
  // One GET, at once: the start command's server is already listening, so the create
  // restored the snapshot the build took (a cold boot would have no server at all).
  const res = await hostGet(sbx, 8080, '/hello.txt')
  console.log(`${label}: create ${took} ms, GET ${sbx.getHost(8080)}/hello.txt -> ${res.status}`)
  check(res.status === 200 && res.body === 'copied by the js sdk\n', `${label}: GET gave ${res.status} ${JSON.stringify(res.body)}`)
  return { sbx, took }
}

async function build(ctx) {
  const logs = []
  const t0 = Date.now()
  const info = await Template.build(jsapp(ctx), 'jsapp', { ...SHAPE, onBuildLogs: (e) => logs.push(e.message) })
  const buildMs = Date.now() - t0
  console.log(`build took ${buildMs} ms`)
  check(info.templateId === 'jsapp' && UUID.test(info.buildId), `build info ${JSON.stringify(info)}`)
  check(JSON.stringify(info.tags) === '["default"]', `tags ${JSON.stringify(info.tags)}`)
  check(logs.includes("Uploaded 'app'") && logs.includes("Uploaded 'run.sh'"), `no uploads in ${logs.join(' | ')}`)
  check(logs.some((m) => m.includes('hello js from the js build')), `no RUN output in ${logs.join(' | ')}`)
  check(await Template.exists('jsapp'), 'exists(jsapp) is false')

  const first = await createAndCheck('first create')
  const sbx = first.sbx
  try {
    check((await sbx.files.read('/app/sub/nested.txt')) === 'nested\n', 'nested file')
    check((await sbx.files.read('/app/.hidden')) === 'dot\n', 'dot file')
    const built = await sbx.files.read('/app/built.txt')
    check(built === 'run.sh ran in /app as user\nhello js\n', `built.txt ${JSON.stringify(built)}`)
    const mode = await sbx.commands.run('stat -c "%a %U" /app/bin/run.sh /app/hello.txt')
    check(mode.stdout === '755 user\n644 user\n', `modes/owners ${JSON.stringify(mode.stdout)}`)
    // WORKDIR and the user are the sandbox's defaults; setEnvs is build-time only (E2B's
    // documented meaning), but the start command ran with it.
    const who = await sbx.commands.run('echo "[$GREETING]"; pwd; whoami')
    check(who.stdout === '[]\n/app\nuser\n', `env/cwd/user ${JSON.stringify(who.stdout)}`)
    const startEnv = await sbx.commands.run(
      "tr '\\0' '\\n' < /proc/$(pgrep -o -f 'http.server 8080')/environ | grep '^GREETING='"
    )
    check(startEnv.stdout === 'GREETING=hello js\n', `start command env ${JSON.stringify(startEnv.stdout)}`)
    check((await guestGet(sbx, 8080)) === '200', 'guest-side GET of 8080')
    const second = await createAndCheck('second create')
    await second.sbx.kill()
    check(second.took < 10_000, `the second create took ${second.took} ms: not a restore`)
  } finally {
    await sbx.kill()
  }

  // An identical build: the JS SDK's file hashes are stable, so nothing is uploaded again
  // and every step is a cache hit (no VM).
  const logs2 = []
  const t1 = Date.now()
  await Template.build(jsapp(ctx), 'jsapp', { ...SHAPE, onBuildLogs: (e) => logs2.push(e.message) })
  const rebuildMs = Date.now() - t1
  console.log(`identical rebuild took ${rebuildMs} ms`)
  check(logs2.includes("Skipping upload of 'app', already cached"), `app uploaded again: ${logs2.join(' | ')}`)
  const cached = logs2.filter((m) => m.startsWith('CACHED')).length
  check(cached === 5, `${cached} CACHED steps in ${logs2.join(' | ')}`)
  check(rebuildMs < buildMs, `rebuild ${rebuildMs} ms is not faster than the build ${buildMs} ms`)
}

async function background() {
  const t = Template().fromTemplate('base').runCmd('echo bg-start; sleep 3; echo bg-end')
  const t0 = Date.now()
  const info = await Template.buildInBackground(t, 'jsbg', { ...SHAPE, tags: ['v1'] })
  console.log(`buildInBackground returned in ${Date.now() - t0} ms: ${JSON.stringify(info)}`)
  check(info.templateId === 'jsbg' && UUID.test(info.buildId), `build info ${JSON.stringify(info)}`)
  check(JSON.stringify(info.tags) === '["v1"]', `tags ${JSON.stringify(info.tags)}`)
  const seen = []
  const messages = []
  let offset = 0
  let status
  const deadline = Date.now() + BUILD_LIMIT_MS
  for (;;) {
    status = await Template.getBuildStatus(info, { logsOffset: offset })
    if (seen[seen.length - 1] !== status.status) seen.push(status.status)
    offset += status.logEntries.length
    messages.push(...status.logEntries.map((e) => e.message))
    if ((status.status === 'ready' || status.status === 'error') && status.logEntries.length === 0) break
    check(Date.now() < deadline, `build not finished in ${BUILD_LIMIT_MS} ms (${seen})`)
    await sleep(500)
  }
  console.log(`statuses ${seen.join(' -> ')}, ${messages.length} log lines`)
  check(status.status === 'ready', `status ${status.status}: ${JSON.stringify(status.reason)}`)
  check(seen.includes('building') && seen.indexOf('building') < seen.indexOf('ready'), `statuses ${seen}`)
  const start = messages.indexOf('bg-start')
  check(start >= 0 && messages.indexOf('bg-end') > start, `step output ${messages.join(' | ')}`)
  // Paging by logsOffset lost and repeated nothing: the pages add up to the whole log.
  const whole = (await Template.getBuildStatus(info, { logsOffset: 0 })).logEntries.map((e) => e.message)
  check(JSON.stringify(whole) === JSON.stringify(messages.slice(0, 100)), 'the pages differ from the log')
  const past = await Template.getBuildStatus(info, { logsOffset: offset })
  check(past.logEntries.length === 0 && past.status === 'ready', 'entries past the end')
  check(await Template.exists('jsbg'), 'exists(jsbg)')
  check(await Template.aliasExists('jsbg'), 'aliasExists(jsbg)')
  check(await Template.exists('jsbg:v1'), 'exists(jsbg:v1)')
  check(!(await Template.exists('jsbg:default')), 'exists(jsbg:default): no ready build has that tag')
  check(!(await Template.exists('never-built-js')), 'exists(never-built-js)')
  const tags = await Template.getTags('jsbg')
  check(tags.length === 1 && tags[0].tag === 'v1' && tags[0].buildId === info.buildId, `tags ${JSON.stringify(tags)}`)
}

async function failing() {
  const t = Template().fromTemplate('base')
  t.runCmd('echo step one')
  const failLine = callerLine() + 1
  t.runCmd('echo about to fail; exit 3')
  const logs = []
  const err = await rejects(
    BuildError,
    () => Template.build(t, 'jsfail', { ...SHAPE, onBuildLogs: (e) => logs.push(e.message) }),
    'a RUN step that exits 3'
  )
  console.log(`BuildError: ${err.message}`)
  check(/step 2 .*exit code 3/.test(err.message), `message ${err.message}`)
  // reason.step "2" points the SDK at the second runCmd's call site.
  check(err.stack.includes(`template_build.mjs:${failLine}:`), `stack does not name line ${failLine}:\n${err.stack}`)
  check(logs.some((m) => m.includes('about to fail')), `no step output in ${logs.join(' | ')}`)
  const created = logs.map((m) => /Build ID: (\S+)/.exec(m)).find(Boolean)
  check(created, 'no build id in the logs')
  const status = await Template.getBuildStatus({ templateId: 'jsfail', buildId: created[1] })
  check(status.status === 'error' && status.reason?.step === '2', `status ${JSON.stringify(status)}`)
  check(status.reason.message === err.message, `reason ${status.reason.message}`)
  check(status.reason.logEntries.some((e) => e.message.includes('about to fail')), 'reason.logEntries')
  check(!(await Template.exists('jsfail:default')), 'a failed build got the default tag')
}

async function image(ctx, registry) {
  check(registry, 'no registry host given')
  const t = Template({ fileContextPath: ctx })
    .fromImage(`${registry}/busybox:1`)
    .copy('app/hello.txt', '/app/')
    .runCmd('echo built > /app/built.txt', { user: 'root' })
    .setStartCmd('httpd -f -p 8080 -h /app', 'wget -q -O /dev/null http://127.0.0.1:8080/hello.txt')
  const logs = []
  const t0 = Date.now()
  await Template.build(t, 'jsbusy', { ...SHAPE, onBuildLogs: (e) => logs.push(e.message) })
  console.log(`image build took ${Date.now() - t0} ms`)
  check(logs.some((m) => m.includes('pulled')), `no pull in ${logs.join(' | ')}`)
  const sbx = await Sandbox.create('jsbusy', { ...CREATE_OPTS, timeoutMs: 300_000 })
  try {
    const res = await hostGet(sbx, 8080, '/hello.txt')
    check(res.status === 200 && res.body === 'copied by the js sdk\n', `GET gave ${res.status} ${res.body}`)
    check((await sbx.files.read('/app/built.txt')) === 'built\n', 'built.txt')
  } finally {
    await sbx.kill()
  }
}

await main({ build, background, failing, image }, 420_000)
