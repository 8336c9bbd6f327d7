"""The client's link to an agentenv server: where it is and with which key (`resolve_target`),
the HTTP calls (`Api`), and how a failure reaches the user (`ClientError`, `_guard`: one line on
stderr and a non-zero exit). Shared by every `aenv` client command module.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import httpx
import typer
from rich.console import Console

from agentenv.config import Settings

err = Console(stderr=True, soft_wrap=True)
DEFAULT_URL = "http://127.0.0.1:8000"
T = TypeVar("T")


class ClientError(Exception):
    """A failure to report to the user as one line."""


def config_path() -> Path:
    base = Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config")
    return base / "agentenv" / "client.json"


def _fail(message: str, code: int = 1) -> NoReturn:
    err.print(f"[red]error:[/red] {message}", highlight=False, markup=True)
    raise typer.Exit(code)


def _guard(fn: Callable[[], T]) -> T:
    try:
        return fn()
    except ClientError as exc:
        _fail(str(exc))
    except httpx.TransportError as exc:
        _fail(f"cannot reach the agentenv server: {exc or type(exc).__name__}")


@dataclass
class Target:
    url: str
    api_key: str


def resolve_target() -> Target:
    """Server URL and key: env vars, then `aenv auth`'s file, then the local server's key."""
    saved: dict[str, str] = {}
    with contextlib.suppress(OSError, ValueError):
        saved = json.loads(config_path().read_text())
    url = (
        os.environ.get("AGENTENV_URL")
        or os.environ.get("E2B_API_URL")
        or saved.get("url")
        or DEFAULT_URL
    )
    key = (
        os.environ.get("AGENTENV_API_KEY") or os.environ.get("E2B_API_KEY") or saved.get("api_key")
    )
    if not key:
        with contextlib.suppress(OSError):
            from agentenv.api.keys import key_file

            key = key_file(Settings.from_env().home).read_text().strip()
    if not key:
        raise ClientError("no API key: run `aenv auth --url URL --key KEY` or set E2B_API_KEY")
    return Target(url.rstrip("/"), key)


class Api:
    def __init__(self, target: Target) -> None:
        self.target = target
        self.http = httpx.Client(
            base_url=target.url,
            headers={"X-API-Key": target.api_key},
            timeout=httpx.Timeout(30.0, read=300.0),
            trust_env=False,
        )

    def call(self, method: str, path: str, **kw: Any) -> httpx.Response:
        resp = self.http.request(method, path, **kw)
        if resp.status_code >= 400:
            try:
                message = resp.json().get("message", resp.text)
            except ValueError:
                message = resp.text or resp.reason_phrase
            raise ClientError(f"{message} (HTTP {resp.status_code})")
        return resp

    def sandbox(self, sandbox_id: str) -> dict[str, Any]:
        body: dict[str, Any] = self.call("GET", f"/sandboxes/{sandbox_id}").json()
        return body


def _api() -> Api:
    return Api(resolve_target())
