"""Structured server logs carry the sandbox id as a field."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator

import pytest

from agentenv.api.logs import configure


@pytest.fixture
def restore_logging() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def test_json_lines_have_the_sandbox_id(
    restore_logging: None, capsys: pytest.CaptureFixture[str]
) -> None:
    configure("info", "json")
    logging.getLogger("agentenv.sandboxes").info(
        "sandbox %s running", "iabc", extra={"sandbox_id": "iabc", "address": "198.18.0.2"}
    )
    line = json.loads(capsys.readouterr().err.strip().splitlines()[-1])
    assert line["msg"] == "sandbox iabc running"
    assert line["sandbox_id"] == "iabc" and line["address"] == "198.18.0.2"
    assert line["level"] == "info" and line["logger"] == "agentenv.sandboxes"


def test_unknown_format_is_refused(restore_logging: None) -> None:
    with pytest.raises(ValueError, match="xml"):
        configure("info", "xml")
