"""`python -m agentenv.guest.envd [--host H] [--port P] [--default-user U] [--guest]`."""

from __future__ import annotations

import argparse
import logging
import sys
import types
from pathlib import Path

from agentenv.ports import ENVD_PORT

from . import ENVD_VERSION


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m agentenv.guest.envd",
        description=f"envd {ENVD_VERSION}: the in-sandbox daemon the E2B SDK talks to.",
    )
    parser.add_argument("--host", default="0.0.0.0", help="address to listen on")
    parser.add_argument("--port", type=int, default=ENVD_PORT, help="port to listen on")
    parser.add_argument(
        "--default-user", default="user", help="user for requests that name none (default: user)"
    )
    parser.add_argument(
        "--guest",
        action="store_true",
        help="running inside a sandbox: /init may set the clock, hostname and RNG",
    )
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning"])
    return parser.parse_args(argv)


def _skip_connectrpc_version_lookup() -> None:
    """Gives connectrpc its version string without importlib.metadata.

    connectrpc looks its own version up at import time, which loads importlib.metadata (and
    email, zipfile, csv...): about two seconds of envd's start in an emulated guest, for a
    string that only ends up in client user-agents. envd serves only, so the pin will do.
    """
    if "connectrpc" in sys.modules:
        return
    pinned = "unknown"
    requirements = Path(__file__).with_name("requirements.txt")
    for line in requirements.read_text().splitlines():
        if line.startswith("connectrpc=="):
            pinned = line.split("==", 1)[1].strip()
    module = types.ModuleType("connectrpc._version")
    module.__version__ = pinned  # type: ignore[attr-defined]
    sys.modules["connectrpc._version"] = module


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(
        stream=sys.stderr,
        level=args.log_level.upper(),
        format="envd %(levelname)s %(message)s",
    )
    # Imported only now: the guest runs Python under emulation, where imports are slow and
    # `--help` should not pay for them.
    _skip_connectrpc_version_lookup()
    import uvicorn

    from ..quiet_server import Server
    from .app import Envd
    from .state import EnvdState

    app = Envd(EnvdState(default_user=args.default_user, guest=args.guest))
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        http="h11",
        loop="asyncio",
        lifespan="on",
        log_level=args.log_level,
        access_log=False,
        # Longer than the SDK's pool keepalive (300 s), so the client always closes an idle
        # connection first and never reuses one envd has just dropped.
        timeout_keep_alive=650,
        # Streams of background processes would hold a graceful shutdown open forever.
        timeout_graceful_shutdown=3,
    )
    Server(config).run()


if __name__ == "__main__":
    main()
