"""envd: the in-guest daemon the E2B SDK talks to on port 49983.

Connect-RPC (JSON codec, HTTP/1.1) for `process.Process` and `filesystem.Filesystem`, plus the
plain HTTP endpoints `/health`, `/init`, `/files`, `/envs` and `/metrics`. It runs as an ordinary
process on the host (tests) or inside the guest, started by `agentenv.guest.init` with `--guest`.

`ENVD_VERSION` is what the control plane reports as `envdVersion`; the SDK turns features on from
it. Every gate up to 0.6.4 is implemented:

- 0.1.4 recursive `watch_dir`; 0.1.5/0.2.4 metrics with disk numbers (`/metrics`)
- 0.3.0 `stdin=False`; 0.4.0 no implicit user (default user from `/init` or `--default-user`)
- 0.5.2 `CloseStdin`; 0.5.7 octet-stream, chunked and gzip uploads
- 0.6.2 file metadata (`X-Metadata-*` headers, kept in `user.` xattrs, returned in EntryInfo)
- 0.6.3 `include_entry` on watch events; 0.6.4 `allow_network_mounts` (watching a network
  filesystem is refused unless it is set)

Only the stdlib, `agentenv.guest` (its port, `agentenv.ports.ENVD_PORT`) and `requirements.txt`
may be imported from here: the guest runs envd from a self-contained runtime on the read-only
tools drive, which holds only `agentenv.guest` (`template.tools.guest_sources`).
"""

ENVD_VERSION = "0.6.4"
