// Shared helpers of the JS SDK scenarios (run by tests/e2e/test_js_sdk.py).
//
// A script is started as `node <script>.mjs <scenario> [sandbox id]` with E2B_API_URL,
// E2B_SANDBOX_URL and E2B_API_KEY pointing at the server under test. It runs one scenario,
// prints `OK <scenario> in <s> s` and exits 0, or prints `FAIL <scenario>: <why>` (and the
// stack) and exits 1. Every scenario runs under its own deadline, so a hung SDK call ends the
// process with a message instead of leaving it to the caller's kill.

import { Sandbox } from 'e2b'

export class Check extends Error {}

export function check(cond, what) {
  if (!cond) throw new Check(what)
}

export function sleep(ms) {
  return new Promise((resolve) => setTimeout(resolve, ms))
}

// The error `fn` rejects with; a Check when it resolves or rejects with another class.
export async function rejects(cls, fn, what) {
  try {
    await fn()
  } catch (err) {
    check(err instanceof cls, `${what}: expected ${cls.name}, got ${err?.constructor?.name}: ${err}`)
    return err
  }
  throw new Check(`${what}: expected ${cls.name}, but it succeeded`)
}

// Polls `probe` (every `everyMs`) until it returns a truthy value, for at most `limitMs`.
export async function until(what, limitMs, probe, everyMs = 250) {
  const deadline = Date.now() + limitMs
  let last
  for (;;) {
    try {
      last = await probe()
      if (last) return last
    } catch (err) {
      last = err
    }
    if (Date.now() > deadline) throw new Check(`${what}: not within ${limitMs} ms (last: ${last})`)
    await sleep(everyMs)
  }
}

// Metadata every sandbox of this run carries, so lists only see this run's sandboxes.
export const RUN = process.env.AGENTENV_JS_RUN ?? 'local'
export const META = { suite: 'js sdk', run: RUN }
export const HOME = '/home/user'
// Creates under TCG restore a snapshot and wait for envd; give them room.
export const CREATE_OPTS = { requestTimeoutMs: 300_000 }

export async function connect(sandboxId) {
  check(sandboxId, 'no sandbox id given')
  return Sandbox.connect(sandboxId, { requestTimeoutMs: 120_000 })
}

// Guest-side HTTP GET of 127.0.0.1:`port` (the guest's Python; the base image has no curl).
export async function guestGet(sbx, port) {
  const code = `import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:${port}/', timeout=5).status)`
  const res = await sbx.commands.run(`python3 -c "${code}"`, { timeoutMs: 30_000 })
  return res.stdout.trim()
}

export async function main(scenarios, limitMs = 240_000) {
  const [name, ...args] = process.argv.slice(2)
  const fn = scenarios[name]
  if (!fn) {
    console.log(`FAIL ${name}: unknown scenario (known: ${Object.keys(scenarios).join(', ')})`)
    process.exit(2)
  }
  const started = Date.now()
  const timer = setTimeout(() => {
    console.log(`FAIL ${name}: still running after ${limitMs} ms`)
    process.exit(3)
  }, limitMs)
  try {
    await fn(...args)
    clearTimeout(timer)
    console.log(`OK ${name} in ${((Date.now() - started) / 1000).toFixed(1)} s`)
    // Open SDK streams (a watch, a background command) must not keep the process alive.
    process.exit(0)
  } catch (err) {
    clearTimeout(timer)
    console.log(`FAIL ${name}: ${err?.constructor?.name}: ${err?.message ?? err}`)
    if (err?.stack) console.log(err.stack)
    process.exit(1)
  }
}
