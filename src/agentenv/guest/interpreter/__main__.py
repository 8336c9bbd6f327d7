"""`python3 -m <package> [--host 0.0.0.0] [--port 49999]`: run the server under uvicorn."""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys

import uvicorn
from uvicorn.config import STARTUP_FAILURE

from .app import build_app
from .kernel import Settings
from .quiet_server import Server


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="code-interpreter server (E2B protocol)")
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=49999)
    parser.add_argument("--envd-url", default="http://127.0.0.1:49983")
    parser.add_argument("--cwd", default="/home/user", help="cwd of the default contexts")
    parser.add_argument(
        "--default-languages",
        default="python",
        help="comma-separated languages whose default context starts before /health is 200",
    )
    parser.add_argument("--keepalive", type=float, default=5.0, help="seconds of silence")
    parser.add_argument("--start-timeout", type=float, default=120.0)
    parser.add_argument("--log-level", default="info")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    settings = Settings(
        envd_url=args.envd_url,
        keepalive=args.keepalive,
        start_timeout=args.start_timeout,
        default_cwd=args.cwd,
    )
    languages = [lang.strip() for lang in args.default_languages.split(",") if lang.strip()]
    app = build_app(settings, languages)
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        access_log=False,
        timeout_keep_alive=640,
    )
    # As uvicorn.run, with the loop that wakes once a second (`quiet_server`).
    server = Server(config)
    with contextlib.suppress(KeyboardInterrupt):
        server.run()
    if not server.started:
        sys.exit(STARTUP_FAILURE)


if __name__ == "__main__":
    main()
