"""Environment variables: the sandbox's (from envd) and a request's `env_vars`.

Kernels start at boot, before the template's snapshot, so they never saw the env vars a sandbox
is created with. Like upstream, the first execution in a context asks envd (`GET /envs`, with the
request's access token) and sets them in the kernel. A request's `env_vars` are set for that
execution only: afterwards each key goes back to the sandbox's value, else to the value the kernel
started with, else it is unset. Values are set by running a small silent snippet in the kernel's
own language, because that is where the code reads them from (os.environ, `$X`).
"""

from __future__ import annotations

import functools
import json
import logging
import re
import shlex
import ssl

import httpx

log = logging.getLogger(__name__)

NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


def check_env_vars(raw: object) -> dict[str, str]:
    """A request's `env_vars` as a str->str dict; ValueError says what is wrong."""
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ValueError("env_vars must be an object of strings")
    out: dict[str, str] = {}
    for key, value in raw.items():
        if not isinstance(key, str) or not NAME.match(key):
            raise ValueError(f"env var name {key!r} is not a valid name")
        if not isinstance(value, str):
            raise ValueError(f"env var {key} must be a string")
        out[key] = value
    return out


@functools.cache
def _tls() -> ssl.SSLContext:
    """One TLS context for the process. httpx builds a verifying one per client, loading the
    CA bundle: 0.4-0.9 s of a TCG guest's CPU, paid by each context's first execution in a
    sandbox. Made once (by the warm-up, so a template's snapshot has it); envd is plain http,
    the context serves only an https envd URL."""
    return httpx.create_ssl_context()


async def fetch_sandbox_envs(envd_url: str, token: str | None, deadline: float) -> dict[str, str]:
    """envd's `GET /envs`; raises on any failure (the caller retries on the next execution)."""
    headers = {"X-Access-Token": token} if token else {}
    async with httpx.AsyncClient(timeout=deadline, verify=_tls()) as client:
        response = await client.get(f"{envd_url.rstrip('/')}/envs", headers=headers)
    response.raise_for_status()
    body = response.json()
    if not isinstance(body, dict):
        raise ValueError(f"envd /envs answered {type(body).__name__}, not an object")
    return {str(k): str(v) for k, v in body.items() if NAME.match(str(k))}


def set_snippet(language: str, values: dict[str, str | None]) -> str:
    """Code that sets (str) or unsets (None) env vars in a kernel of `language`; '' if unknown."""
    if not values:
        return ""
    if language == "python":
        payload = json.dumps(values)
        return (
            "import os as _agentenv_os, json as _agentenv_json\n"
            f"for _k, _v in _agentenv_json.loads({payload!r}).items():\n"
            "    if _v is None:\n"
            "        _agentenv_os.environ.pop(_k, None)\n"
            "    else:\n"
            "        _agentenv_os.environ[_k] = _v\n"
            "del _agentenv_os, _agentenv_json, _k, _v"
        )
    if language == "bash":
        parts = [
            f"unset {key}" if value is None else f"export {key}={shlex.quote(value)}"
            for key, value in values.items()
        ]
        return "\n".join(parts)
    if language in ("javascript", "typescript"):
        parts = [
            f"delete process.env[{json.dumps(key)}];"
            if value is None
            else f"process.env[{json.dumps(key)}] = {json.dumps(value)};"
            for key, value in values.items()
        ]
        return "\n".join(parts)
    if language == "r":
        parts = [
            f"Sys.unsetenv({json.dumps(key)})"
            if value is None
            else f"Sys.setenv({key} = {json.dumps(value)})"
            for key, value in values.items()
        ]
        return "\n".join(parts)
    log.warning("no env-var snippet for language %s", language)
    return ""


def restore_values(
    keys: list[str], sandbox: dict[str, str], started_with: dict[str, str]
) -> dict[str, str | None]:
    """What each per-request key goes back to after the execution."""
    return {key: sandbox.get(key, started_with.get(key)) for key in keys}
