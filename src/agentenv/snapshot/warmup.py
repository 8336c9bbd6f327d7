"""What a template's guest does once before its capture, so that no clone has to: a first
command, file write and file read through envd, as the SDKs send them.

Every clone restores the template's RAM, so whatever the guest does lazily on its first
request (the login shell and its files read from disk into the page cache, envd's first
thread-pool workers, its user lookup, the file handler's first response) was paid again by
every sandbox, under TCG in guest CPU: measured on the 2-core dev machine, a clone's first
`files.write` + `files.read` cost 520-580 ms of its QEMU's CPU and its first
`commands.run("true")` 370-500 ms; from a template that did them before its capture, 60-130
and 280-380 ms (later ones ~100-170 ms either way: the rest is TCG translating code afresh
in each new QEMU, which no snapshot keeps).

Best effort: a template whose image has no bash or no such user still builds (the step that
failed is logged), and the whole warm-up has a deadline. It leaves nothing in the guest's
filesystem (its file is removed); envd keeps no record of an ended process."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from agentenv.guest.envd.client import EnvdClient, EnvdError
from agentenv.guest.init import LOG_DIR, START_FAILED

log = logging.getLogger(__name__)

# The SDKs' user when a template names none (E2B's templates have it).
DEFAULT_USER = "user"
PROBE = "/tmp/.agentenv-warm-up"
# Each step (a cold guest under TCG answers its first request in about a second).
STEP_TIMEOUT_S = 30.0


async def warm_up(envd_url: str, user: str | None = None) -> list[str]:
    """Run the first requests a clone would; returns the steps that failed, with why."""
    as_user = user or DEFAULT_USER
    failed: list[str] = []
    async with EnvdClient(envd_url, timeout=STEP_TIMEOUT_S) as envd:

        async def remove() -> None:
            await envd.run(f"rm -f {PROBE}", user=as_user, timeout=STEP_TIMEOUT_S)

        steps: list[tuple[str, Callable[[], Awaitable[object]]]] = [
            ("a command", lambda: envd.run("true", user=as_user, timeout=STEP_TIMEOUT_S)),
            ("a file write", lambda: envd.write_file(PROBE, b"warm\n", as_user)),
            ("a file read", lambda: envd.read_file(PROBE, as_user)),
            ("its removal", remove),
        ]
        for what, step in steps:
            try:
                async with asyncio.timeout(STEP_TIMEOUT_S + 5.0):
                    await step()
            except (EnvdError, TimeoutError) as exc:
                failed.append(f"{what}: {exc}")
    for why in failed:
        log.info("template warm-up as %r: %s", as_user, why)
    return failed


async def start_failures(envd_url: str) -> str | None:
    """The template's start hooks that did not end well at its boot, as the guest init
    recorded them (`guest.init.START_FAILED`), each with the last lines of its log; None when
    all did. A capture then would hold a service its hook gave up waiting for (seen: dockerd
    still starting after the hook's budget, on a loaded host), in every clone."""
    async with EnvdClient(envd_url, timeout=STEP_TIMEOUT_S) as envd:
        try:
            record = (await envd.read_file(str(START_FAILED), "root")).decode(errors="replace")
        except EnvdError as exc:
            if exc.code in ("404", "not_found"):
                return None
            raise
        parts = []
        for line in record.splitlines():
            name = line.split(":", 1)[0]
            try:
                tail = await envd.read_file(str(LOG_DIR / f"start-{name}.log"), "root")
            except EnvdError:
                tail = b""
            last = tail.decode(errors="replace").strip().splitlines()[-5:]
            parts.append(f"{line}" + (f" (its log ends: {' | '.join(last)})" if last else ""))
        return "; ".join(parts)
