// Lifecycle through the E2B JS SDK: timeout (kill and auto-pause), pause/resume, persistent
// snapshots and fork. `pause_resume`, `snapshot`, `fork` and `expire` take the shared
// sandbox of sandbox.mjs (its http.server child from `background_child` still running);
// `timeout` makes its own.

import { NotFoundError, Sandbox, SandboxNotFoundError } from 'e2b'

import { CREATE_OPTS, HOME, META, RUN, check, connect, guestGet, main, rejects, sleep, until } from './lib.mjs'

const MARKER = `${HOME}/lifecycle-marker`

async function stateOf(id) {
  return (await Sandbox.getInfo(id)).state
}

// What the guest kept: a file on disk and a process in memory (the http.server child).
async function kept(sbx, marker, what) {
  check((await sbx.files.read(MARKER)) === marker, `${what}: file content lost`)
  check((await guestGet(sbx, 8000)) === '200', `${what}: the background http.server is gone`)
}

async function timeout() {
  // Default action: the sandbox is killed when its timeout passes.
  const gone = await Sandbox.create('base', { ...CREATE_OPTS, timeoutMs: 5_000, metadata: META })
  const left = ((await gone.getInfo()).endAt.getTime() - Date.now()) / 1000
  check(left <= 5.5, `endAt ${left.toFixed(1)} s away with timeoutMs 5000`)
  await until('killed at its timeout', 60_000, async () => {
    try {
      await Sandbox.getInfo(gone.sandboxId)
      return false
    } catch (err) {
      return err instanceof SandboxNotFoundError
    }
  }, 500)
  check((await gone.isRunning()) === false, 'isRunning() after the timeout')
  await rejects(NotFoundError, () => Sandbox.connect(gone.sandboxId), 'connect after the timeout')

  // onTimeout 'pause': paused instead, and connect brings it back with what it held.
  const sbx = await Sandbox.create('base', {
    ...CREATE_OPTS,
    timeoutMs: 8_000,
    metadata: META,
    lifecycle: { onTimeout: 'pause', autoResume: false },
  })
  try {
    await sbx.files.write(`${HOME}/before-pause`, 'still here')
    const info = await sbx.getInfo()
    check(info.lifecycle?.onTimeout === 'pause', `lifecycle ${JSON.stringify(info.lifecycle)}`)
    await until('auto-paused at its timeout', 90_000, async () => (await stateOf(sbx.sandboxId)) === 'paused', 500)
    const back = await Sandbox.connect(sbx.sandboxId, { timeoutMs: 120_000, requestTimeoutMs: 300_000 })
    check((await stateOf(sbx.sandboxId)) === 'running', 'not running after connect')
    check((await back.files.read(`${HOME}/before-pause`)) === 'still here', 'file lost across auto-pause')
    // A paused sandbox can be killed as it is.
    check((await back.pause()) === true, 'pause after the resume')
    check((await Sandbox.kill(sbx.sandboxId)) === true, 'kill of a paused sandbox')
    await rejects(SandboxNotFoundError, () => Sandbox.getInfo(sbx.sandboxId), 'getInfo after the kill')
  } finally {
    await Sandbox.kill(sbx.sandboxId)
  }
}

async function pauseResume(id) {
  const sbx = await connect(id)
  await sbx.files.write(MARKER, 'before pause')
  check((await guestGet(sbx, 8000)) === '200', 'the http.server of background_child is not running')
  check((await sbx.pause({ requestTimeoutMs: 300_000 })) === true, 'pause')
  check((await stateOf(id)) === 'paused', 'getInfo state after pause')
  check((await Sandbox.pause(id)) === false, 'a second pause must report already paused')
  const paused = await Sandbox.list({ query: { metadata: META, state: ['paused'] } }).nextItems()
  check(paused.some((s) => s.sandboxId === id), 'not listed as paused')
  const t0 = Date.now()
  const back = await Sandbox.connect(id, { timeoutMs: 900_000, requestTimeoutMs: 300_000 })
  console.log(`resume by connect took ${Date.now() - t0} ms`)
  check((await stateOf(id)) === 'running', 'not running after connect')
  await kept(back, 'before pause', 'pause/resume')
}

async function snapshot(id) {
  const sbx = await connect(id)
  await sbx.files.write(MARKER, 'in the snapshot')
  const name = `js-${RUN}`
  const snap = await sbx.createSnapshot({ name, requestTimeoutMs: 300_000 })
  check(snap.snapshotId && snap.names.includes(name), `snapshot ${JSON.stringify(snap)}`)
  check((await stateOf(id)) === 'running', 'source not running after the snapshot')
  await sbx.files.write(MARKER, 'after the snapshot')
  // Created by the snapshot's name (the id works as well: sdk_snapshot_scenarios.py).
  const child = await Sandbox.create(name, { ...CREATE_OPTS, timeoutMs: 300_000, metadata: META })
  try {
    check(child.sandboxId !== id, 'a sandbox from a snapshot got the source id')
    await kept(child, 'in the snapshot', 'sandbox from the snapshot')
    const listed = []
    const pager = Sandbox.listSnapshots({ sandboxId: id })
    for (let pages = 0; pager.hasNext && pages < 10; pages++) listed.push(...(await pager.nextItems()))
    check(listed.some((s) => s.snapshotId === snap.snapshotId), `not in listSnapshots: ${listed.map((s) => s.snapshotId)}`)
    // Two sandboxes of this run now: one per page with limit 1.
    const pages = []
    const byMeta = Sandbox.list({ query: { metadata: META }, limit: 1 })
    while (byMeta.hasNext && pages.length < 10) pages.push((await byMeta.nextItems()).map((s) => s.sandboxId))
    const ids = pages.flat().sort()
    check(pages.length === 2 && JSON.stringify(ids) === JSON.stringify([id, child.sandboxId].sort()), `pages ${JSON.stringify(pages)}`)
  } finally {
    await child.kill()
  }
  check((await sbx.files.read(MARKER)) === 'after the snapshot', 'source lost its own write')
  check((await Sandbox.deleteSnapshot(snap.snapshotId)) === true, 'deleteSnapshot')
  check((await Sandbox.deleteSnapshot(snap.snapshotId)) === false, 'second deleteSnapshot')
}

async function fork(id) {
  const sbx = await connect(id)
  await sbx.files.write(MARKER, 'before the fork')
  const t0 = Date.now()
  const kids = await sbx.fork({ count: 1, timeoutMs: 300_000, requestTimeoutMs: 300_000 })
  console.log(`fork took ${Date.now() - t0} ms`)
  try {
    check(kids.length === 1, `${kids.length} fork results`)
    check(!(kids[0] instanceof Error), `fork failed: ${kids[0]}`)
    const kid = kids[0]
    check(kid instanceof Sandbox && kid.sandboxId !== id, `fork id ${kid.sandboxId}`)
    await kept(kid, 'before the fork', 'fork child')
    await kid.files.write(MARKER, 'child only')
    const host = async (s) => (await s.commands.run('hostname')).stdout.trim()
    check((await host(kid)) !== (await host(sbx)), 'fork child kept the parent hostname')
    check((await sbx.files.read(MARKER)) === 'before the fork', "the child's write reached the parent")
    check((await stateOf(id)) === 'running', 'parent not running after the fork')
  } finally {
    for (const k of kids) if (k instanceof Sandbox) await k.kill()
  }
}

async function expire(id) {
  const sbx = await connect(id)
  await sbx.setTimeout(3_000)
  await sleep(3_000)
  await until('gone after setTimeout', 60_000, async () => (await sbx.isRunning()) === false, 500)
  await rejects(SandboxNotFoundError, () => Sandbox.getInfo(id), 'getInfo after expiry')
}

await main({ timeout, pause_resume: pauseResume, snapshot, fork, expire }, 420_000)
