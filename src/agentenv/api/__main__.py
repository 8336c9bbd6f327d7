"""`python -m agentenv.api`: the server without the CLI (used by tests and benches)."""

from __future__ import annotations

import argparse
from pathlib import Path

from agentenv.api.server import serve


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m agentenv.api")
    parser.add_argument("--host", default=None)
    parser.add_argument("--port", type=int, default=None)
    parser.add_argument("--domain", default=None)
    parser.add_argument("--cert", type=Path, default=None)
    parser.add_argument("--key", type=Path, default=None)
    parser.add_argument("--log-level", default="info")
    args = parser.parse_args()
    serve(
        args.host,
        args.port,
        certfile=args.cert,
        keyfile=args.key,
        domain=args.domain,
        log_level=args.log_level,
    )


if __name__ == "__main__":
    main()
