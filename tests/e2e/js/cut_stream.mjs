// A sandbox killed while a command streams, through the E2B JS SDK (run by
// tests/proxy/test_cut_streams.py against a stand-in envd behind the real proxy).
//
// `killed_while_running <sandbox id>` starts `sleep 60` in the background, prints
// `STARTED pid=<pid>` (the caller kills the sandbox then) and expects `wait()` to reject with
// the SDK's TimeoutError carrying the proxy's `unavailable` message.

import { TimeoutError } from 'e2b'

import { check, connect, main, rejects } from './lib.mjs'

async function killedWhileRunning(sandboxId) {
  const sbx = await connect(sandboxId)
  const handle = await sbx.commands.run('sleep 60', { background: true, timeoutMs: 0 })
  console.log(`STARTED pid=${handle.pid}`)
  const err = await rejects(TimeoutError, () => handle.wait(), 'wait() on a killed sandbox')
  // The proxy ends the stream with `unavailable` (as E2B's); this SDK maps that code to
  // its TimeoutError without a health probe.
  check(
    err.message.includes(`the connection to sandbox ${sandboxId} ended before the stream completed`),
    `TimeoutError message: ${err.message}`,
  )
}

await main({ killed_while_running: killedWhileRunning }, 60_000)
