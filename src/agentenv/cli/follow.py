"""Following a template build from the client: the log as it grows (on stdout) and, while the
build pulls an image, one progress bar per layer and phase (download, then conversion into a
block layer) on stderr, from the server's progress route (`agentenv.api.build_progress`).

Used by `aenv pull` and `aenv build`; a build that fails ends as a `ClientError` carrying
the server's reason.
"""

from __future__ import annotations

import time
from typing import Any

import httpx
from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TransferSpeedColumn,
)

from agentenv.cli.connection import Api, ClientError

FOLLOW_DEADLINE_S = 6 * 3600.0
POLL_S = 0.3
DONE = ("ready", "error")


def format_entry(entry: dict[str, Any]) -> str:
    step = entry.get("step")
    prefix = f"[{step}] " if step else ""
    return f"{str(entry.get('timestamp', ''))[11:19]} {prefix}{entry.get('message', '')}"


class LayerBars:
    """One bar per (layer, phase) the server reports, created as they first appear; nothing
    at all is drawn for a build that pulls no image."""

    def __init__(self, console: Console) -> None:
        self.progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            DownloadColumn(),
            TransferSpeedColumn(),
            TimeElapsedColumn(),
            console=console,
            transient=False,
        )
        self.tasks: dict[tuple[int, str], TaskID] = {}
        self.started = False

    def __enter__(self) -> LayerBars:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.started:
            self.progress.stop()

    def update(self, rows: list[dict[str, Any]]) -> None:
        if rows and not self.started:
            self.progress.start()
            self.started = True
        for row in rows:
            key = (int(row["layer"]), str(row["phase"]))
            total = max(int(row["total"]), 1)
            done = min(int(row["done"]), total)
            if key not in self.tasks:
                verb = "download" if key[1] == "download" else "convert "
                label = f"layer {key[0]}/{row['layers']} {verb}"
                if row.get("cached"):
                    label += " (cached)"
                self.tasks[key] = self.progress.add_task(label, total=total)
            self.progress.update(self.tasks[key], completed=done, total=total)

    def finish(self) -> None:
        for task in self.progress.tasks:
            if not task.finished:
                self.progress.update(task.id, completed=task.total)


def follow_build(api: Api, template_id: str, build_id: str, console: Console) -> dict[str, Any]:
    """Print the build's log until it is ready (return its last status) or failed (raise)."""
    offset = 0
    deadline = time.monotonic() + FOLLOW_DEADLINE_S
    # The progress route is ours: it is asked until every layer is complete, or until the build
    # is past its base with nothing reported (no image), or not at all on a server without it.
    watch_pull = True
    past_base = False
    with LayerBars(console) as bars:
        while True:
            body = api.call(
                "GET",
                f"/templates/{template_id}/builds/{build_id}/status",
                params={"logsOffset": offset},
            ).json()
            entries: list[dict[str, Any]] = body.get("logEntries", [])
            for entry in entries:
                print(format_entry(entry), flush=True)
                past_base = past_base or entry.get("step") not in (None, "base")
            offset += len(entries)
            status = body.get("status")
            if watch_pull:
                rows = _progress(api, template_id, build_id)
                if rows:
                    bars.update(rows)
                nothing = not rows and (past_base or status in DONE)
                watch_pull = not (rows is None or nothing or (rows and _complete(rows)))
            if entries:
                continue  # drain every page before deciding
            if status in DONE:
                if status == "ready":
                    bars.finish()
                    return dict(body)
                reason = body.get("reason") or {}
                raise ClientError(f"build failed: {reason.get('message', 'unknown reason')}")
            if time.monotonic() > deadline:
                raise ClientError("gave up following the build")
            time.sleep(POLL_S)


def _complete(rows: list[dict[str, Any]]) -> bool:
    """Every layer downloaded and converted."""
    layers = int(rows[0]["layers"])
    finished = {(r["layer"], r["phase"]) for r in rows if int(r["done"]) >= int(r["total"])}
    return len(finished) >= 2 * layers


def _progress(api: Api, template_id: str, build_id: str) -> list[dict[str, Any]] | None:
    try:
        resp = api.http.get(f"/templates/{template_id}/builds/{build_id}/progress")
    except httpx.HTTPError:
        return None
    if resp.status_code != 200:
        return None
    layers = resp.json().get("layers")
    return layers if isinstance(layers, list) else None
