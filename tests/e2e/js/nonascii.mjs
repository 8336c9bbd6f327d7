// Non-ASCII names through the E2B JS SDK against a live server (run by
// tests/e2e/test_agent_backend.py on its sandbox): query parameters (read, write, the signed
// download and upload URLs), RPC paths (makeDir, list, getInfo, rename, remove), a batch
// write, a watch's events and a command's cwd and env. Each name arrives as written.

import { FilesystemEventType } from 'e2b'

import { check, connect, main, until } from './lib.mjs'

const DIR = '/home/user/js 目录 ñ 🚀'
// Not ASCII, and ASCII that means something in a URL or a query.
const NAME = '文件 é+&#?%20=;ü.txt'
const TEXT = 'é 🚀 中文'

async function nonAscii(sandboxId) {
  const sbx = await connect(sandboxId)
  check((await sbx.files.makeDir(DIR)) === true, `makeDir ${DIR}`)
  const events = []
  const watch = await sbx.files.watchDir(DIR, (e) => events.push(e), { timeoutMs: 60_000 })
  const info = await sbx.files.write(`${DIR}/${NAME}`, TEXT)
  check(info.name === NAME && info.path === `${DIR}/${NAME}`, `write: ${JSON.stringify(info)}`)
  await until('the watch sees the write', 30_000, () =>
    events.some((e) => e.name === NAME && e.type === FilesystemEventType.WRITE),
  )
  await watch.stop()
  check(
    events.some((e) => e.name === NAME && e.type === FilesystemEventType.CREATE),
    `events ${JSON.stringify(events)}`,
  )
  check((await sbx.files.read(`${DIR}/${NAME}`)) === TEXT, 'read back')
  check((await sbx.files.getInfo(`${DIR}/${NAME}`)).size === Buffer.byteLength(TEXT), 'size')

  const batch = [
    { path: `${DIR}/子/日本語.txt`, data: 'ja' },
    { path: `${DIR}/子/😀 ü.bin`, data: new Uint8Array([0, 255, 1]).buffer },
  ]
  const written = await sbx.files.write(batch)
  const paths = written.map((w) => w.path).sort()
  check(
    JSON.stringify(paths) === JSON.stringify(batch.map((b) => b.path).sort()),
    `batch ${paths}`,
  )
  const listed = (await sbx.files.list(DIR, { depth: 2 })).map((e) => e.path).sort()
  const want = [`${DIR}/${NAME}`, `${DIR}/子`, ...batch.map((b) => b.path)].sort()
  check(JSON.stringify(listed) === JSON.stringify(want), `list ${JSON.stringify(listed)}`)

  // Signed URLs (the server finds the sandbox by the signature over the decoded path).
  const got = await fetch(await sbx.downloadUrl(`${DIR}/${NAME}`))
  check(got.status === 200, `download ${got.status}: ${await got.clone().text()}`)
  check((await got.text()) === TEXT, 'download body')
  const form = new FormData()
  form.append('file', new Blob([new Uint8Array([7, 0, 255])]), 'ignored')
  const up = await fetch(await sbx.uploadUrl(`${DIR}/上传 ü.bin`), { method: 'POST', body: form })
  check(up.status === 200, `upload ${up.status}: ${await up.clone().text()}`)
  const bytes = await sbx.files.read(`${DIR}/上传 ü.bin`, { format: 'bytes' })
  check(JSON.stringify([...bytes]) === '[7,0,255]', `uploaded ${[...bytes]}`)

  const res = await sbx.commands.run('ls; echo "$ODD"', { cwd: DIR, envs: { ODD: 'ñ 🚀' } })
  const lines = res.stdout.split('\n').filter(Boolean)
  check(lines.includes(NAME) && lines.includes('子') && lines.at(-1) === 'ñ 🚀', res.stdout)

  const moved = await sbx.files.rename(`${DIR}/${NAME}`, `${DIR}/ünï 😀.txt`)
  check(moved.path === `${DIR}/ünï 😀.txt`, `rename ${moved.path}`)
  await sbx.files.remove(DIR)
  check(!(await sbx.files.exists(DIR)), 'removed')
}

await main({ non_ascii: nonAscii })
