"""Server logging: plain text for a terminal, one JSON object per line for collectors.

Sandbox lifecycle records carry ``extra={"sandbox_id": …}`` so either format can be filtered by
sandbox.
"""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime

_FIELDS = ("sandbox_id", "template", "address", "status", "duration_ms")


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, object] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for name in _FIELDS:
            if hasattr(record, name):
                doc[name] = getattr(record, name)
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return json.dumps(doc, default=str)


def configure(level: str, fmt: str) -> None:
    if fmt not in ("text", "json"):
        raise ValueError(f"log format {fmt!r}: expected text or json")
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # One line per upstream request would drown the sandbox lifecycle lines.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    # qemu.qmp says at INFO that each QMP connection ended ("Task.Reader: end-of-file"): a
    # line per QEMU that exits, which the sandbox's own lines already tell.
    logging.getLogger("qemu.qmp").setLevel(logging.WARNING)
