"""How CLI commands print rows: a table for people, JSON for pipes. Split from `client.py`
so the admin and node commands print the same way without importing the client commands."""

from __future__ import annotations

import json
import sys
from typing import Any

from rich.console import Console
from rich.table import Table


def emit(rows: list[dict[str, Any]], columns: list[tuple[str, str]]) -> None:
    """A table for people, JSON for pipes."""
    if not sys.stdout.isatty():
        json.dump(rows, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return
    table = Table(*(title for title, _ in columns))
    for row in rows:
        table.add_row(*(_cell(row.get(key)) for _, key in columns))
    Console().print(table)


def _cell(value: Any) -> str:
    if isinstance(value, dict):
        return ", ".join(f"{k}={v}" for k, v in value.items())
    return "" if value is None else str(value)
