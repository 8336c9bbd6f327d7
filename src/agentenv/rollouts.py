"""A small typed client for what the E2B SDKs cannot ask: the rollout calls of agentenv's API.

The SDKs send only E2B's fields, so a harness makes its sandboxes here and then drives each one
with the SDK as usual (`Sandbox.connect(sandbox_id)`):

    from e2b import Sandbox
    from agentenv.rollouts import Rollouts

    with Rollouts() as api:                      # E2B_API_URL / E2B_API_KEY, as the SDK
        ids = api.fork_snapshot("task-17", count=8, timeout=600)
        boxes = [Sandbox.connect(i) for i in ids]

It imports nothing of the server (httpx only), so it works in any environment that has the
SDK. Every call has a deadline; every refusal is a `RolloutError` with the server's status,
message and `Retry-After`.
"""

from __future__ import annotations

import os
from types import TracebackType
from typing import Any

import httpx

__all__ = ["RolloutError", "Rollouts"]

DEFAULT_API_URL = "https://api.e2b.app"
# A create may wait for capacity on a busy node (AGENTENV_CAPACITY_WAIT_S, 30 s) and then
# restore; a fork of N starts N.
REQUEST_TIMEOUT_S = 120.0


class RolloutError(Exception):
    """The server refused a call: `status` and its `message`; `retry_after` (seconds) when the
    server said when trying again may help (429, 503)."""

    def __init__(self, status: int, message: str, retry_after: int | None = None) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status
        self.message = message
        self.retry_after = retry_after


class Rollouts:
    """The rollout calls against one server. Use it as a context manager, or `close()` it."""

    def __init__(
        self,
        api_url: str | None = None,
        api_key: str | None = None,
        *,
        timeout_s: float = REQUEST_TIMEOUT_S,
    ) -> None:
        key = api_key or os.environ.get("E2B_API_KEY")
        if not key:
            raise ValueError("no API key: pass api_key or set E2B_API_KEY")
        self._timeout_s = timeout_s
        self._http = httpx.Client(
            base_url=api_url or os.environ.get("E2B_API_URL") or DEFAULT_API_URL,
            headers={"X-API-Key": key},
            timeout=timeout_s,
        )

    def __enter__(self) -> Rollouts:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def create(
        self,
        template: str = "base",
        *,
        timeout: int = 300,
        grace_period: int | None = None,
        keepalive: int = 0,
        metadata: dict[str, str] | None = None,
        env_vars: dict[str, str] | None = None,
        capacity_wait: int | None = None,
    ) -> str:
        """A new sandbox; its id. `grace_period`: after `timeout` it is paused (memory kept)
        this many seconds before it is deleted (None: the server's default). `keepalive`:
        killed once no client touched it for this many seconds (0: off). `capacity_wait`:
        how long it may queue for capacity before a 503 (None: the server's default; 0:
        refuse at once); the request's own deadline grows by as much."""
        body: dict[str, Any] = {
            "templateID": template,
            "timeout": timeout,
            "keepalive": keepalive,
            "metadata": metadata or {},
            "envVars": env_vars or {},
        }
        if grace_period is not None:
            body["gracePeriod"] = grace_period
        extra_s = 0.0
        if capacity_wait is not None:
            body["capacityWait"] = capacity_wait
            extra_s = float(capacity_wait)
        return str(self._call("POST", "/v2/sandboxes", body, extra_s)["sandboxID"])

    def fork(self, sandbox_id: str, count: int = 1, *, timeout: int = 300) -> list[str]:
        """`count` children of a running or paused sandbox (a paused one stays paused),
        from one capture of it, all or none; their ids."""
        rows = self._call("POST", f"/sandboxes/{sandbox_id}/fork", _fork(count, timeout))
        return [str(row["sandbox"]["sandboxID"]) for row in rows]

    def fork_snapshot(self, snapshot: str, count: int = 1, *, timeout: int = 300) -> list[str]:
        """`count` sandboxes from a persistent snapshot (id or name), all or none; their ids."""
        rows = self._call("POST", f"/snapshots/{snapshot}/fork", _fork(count, timeout))
        return [str(row["sandbox"]["sandboxID"]) for row in rows]

    def reset(self, sandbox_id: str, snapshot: str | None = None) -> str:
        """Put a running sandbox back to the state it was created from (or to `snapshot`),
        keeping its id, tokens, metadata and deadline; its id."""
        body = {"snapshot": snapshot} if snapshot is not None else {}
        return str(self._call("POST", f"/sandboxes/{sandbox_id}/reset", body)["sandboxID"])

    def touch(self, sandbox_id: str) -> str:
        """Tell a sandbox with a keepalive that its client is still there; its state."""
        return str(self._call("GET", f"/sandboxes/{sandbox_id}")["state"])

    def kill(self, sandbox_id: str) -> bool:
        """Kill a sandbox; False if it was already gone."""
        try:
            self._call("DELETE", f"/sandboxes/{sandbox_id}")
        except RolloutError as exc:
            if exc.status == 404:
                return False
            raise
        return True

    def _call(
        self, method: str, path: str, body: dict[str, Any] | None = None, extra_s: float = 0.0
    ) -> Any:
        try:
            resp = self._http.request(method, path, json=body, timeout=self._timeout_s + extra_s)
        except httpx.HTTPError as exc:
            raise RolloutError(0, f"{method} {path}: {type(exc).__name__}: {exc}") from exc
        if resp.status_code >= 400:
            try:
                message = str(resp.json().get("message") or resp.text)
            except ValueError:
                message = resp.text
            retry = resp.headers.get("retry-after")
            raise RolloutError(
                resp.status_code, message, int(retry) if retry and retry.isdigit() else None
            )
        return resp.json() if resp.content else None


def _fork(count: int, timeout: int) -> dict[str, int]:
    return {"count": count, "timeout": timeout}
