"""Jupyter messages -> the NDJSON lines of `POST /execute`.

The e2b-code-interpreter SDKs parse these lines (`e2b_code_interpreter.models._parse_output`):
`stdout`/`stderr` carry `text` and `timestamp`, `result` carries one key per MIME type it knows
plus `extra` for the rest, `error` carries `name`/`value`/`traceback` as strings,
`number_of_executions` carries `execution_count`. Pure functions, so they are tested without a
kernel.
"""

from __future__ import annotations

import datetime
from typing import Any

Line = dict[str, Any]

# MIME type -> the key the SDK's `Result` takes (upstream's result model, same order).
MIME_KEYS: tuple[tuple[str, str], ...] = (
    ("text/plain", "text"),
    ("text/html", "html"),
    ("text/markdown", "markdown"),
    ("image/svg+xml", "svg"),
    ("image/png", "png"),
    ("image/jpeg", "jpeg"),
    ("application/pdf", "pdf"),
    ("text/latex", "latex"),
    ("application/json", "json"),
    ("application/javascript", "javascript"),
    ("e2b/data", "data"),
    ("e2b/chart", "chart"),
)


def timestamp(header: dict[str, Any]) -> str:
    """The message's date as an ISO string (upstream sends the kernel's header date)."""
    date = header.get("date")
    if isinstance(date, datetime.datetime):
        return date.isoformat()
    if isinstance(date, str) and date:
        return date
    return datetime.datetime.now(datetime.UTC).isoformat()


def result_line(data: dict[str, Any], is_main_result: bool) -> Line:
    """A `result` line from a display_data/execute_result bundle.

    Like upstream, a `text/plain` wrapped in one pair of quotes loses them (the repr of a str
    result reads as the str), and MIME types without a key of their own go to `extra`.
    """
    rest = dict(data)
    line: Line = {"type": "result", "is_main_result": is_main_result}
    for mime, key in MIME_KEYS:
        value = rest.pop(mime, None)
        if value is None:
            continue
        quoted = isinstance(value, str) and len(value) >= 2 and value[0] == value[-1]
        if key == "text" and quoted and value[0] in "'\"":
            value = value[1:-1]
        if key == "chart" and not value:
            continue
        line[key] = value
    line["extra"] = rest
    return line


def error_line(name: str, value: str, traceback: list[str] | str) -> Line:
    """An `error` line; the traceback list is joined into one string (the SDK wants a str)."""
    text = traceback if isinstance(traceback, str) else "\n".join(traceback)
    return {"type": "error", "name": name, "value": value, "traceback": text}


def iopub_line(msg: dict[str, Any]) -> Line | None:
    """The line an iopub message becomes, or None for the ones that carry no output."""
    kind = msg.get("msg_type") or msg["header"].get("msg_type")
    content: dict[str, Any] = msg.get("content", {})
    if kind == "stream":
        name = content.get("name")
        if name not in ("stdout", "stderr"):
            return None
        return {
            "type": name,
            "text": content.get("text", ""),
            "timestamp": timestamp(msg["header"]),
        }
    if kind == "display_data":
        return result_line(content.get("data", {}), is_main_result=False)
    if kind == "execute_result":
        return result_line(content.get("data", {}), is_main_result=True)
    if kind == "error":
        return error_line(
            str(content.get("ename", "")),
            str(content.get("evalue", "")),
            content.get("traceback", []),
        )
    if kind == "execute_input":
        return {"type": "number_of_executions", "execution_count": content.get("execution_count")}
    return None


KEEPALIVE: Line = {"type": "keepalive"}
END: Line = {"type": "end_of_execution"}
