// A sandbox killed while a command streams, through the E2B JS SDK (run by
// tests/proxy/test_cut_streams.py against a stand-in envd behind the real proxy).
//
// `killed_while_running <sandbox id>` starts `sleep 60` in the background, prints
// `STARTED pid=<pid>` (the caller kills the sandbox then) and expects `wait()` to reject with
// the SDK's TimeoutError saying the sandbox was killed while the request was in flight: what
// the SDK makes of a dropped stream once `/health` answers 502.

import { TimeoutError } from 'e2b'

import { check, connect, main, rejects } from './lib.mjs'

async function killedWhileRunning(sandboxId) {
  const sbx = await connect(sandboxId)
  const handle = await sbx.commands.run('sleep 60', { background: true, timeoutMs: 0 })
  console.log(`STARTED pid=${handle.pid}`)
  const err = await rejects(TimeoutError, () => handle.wait(), 'wait() on a killed sandbox')
  check(
    err.message.includes('killed or reached its end of life'),
    `TimeoutError message: ${err.message}`,
  )
}

await main({ killed_while_running: killedWhileRunning }, 60_000)
