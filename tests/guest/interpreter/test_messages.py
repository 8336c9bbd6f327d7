"""Jupyter messages -> `/execute` lines, checked against the official SDK's parser."""

from __future__ import annotations

import datetime
import json

from e2b_code_interpreter.models import Execution, parse_output

from agentenv.guest.interpreter import messages


def parsed(*lines: messages.Line) -> Execution:
    execution = Execution()
    for line in lines:
        parse_output(execution, json.dumps(line))
    return execution


def test_result_mime_keys_quotes_and_extra() -> None:
    line = messages.result_line(
        {"text/plain": "'a str'", "text/html": "<b>x</b>", "application/x-custom": "y"},
        is_main_result=True,
    )
    assert line["text"] == "a str" and line["html"] == "<b>x</b>"
    assert line["extra"] == {"application/x-custom": "y"}
    ex = parsed(line)
    assert ex.text == "a str" and ex.results[0].html == "<b>x</b>"
    assert ex.results[0].extra == {"application/x-custom": "y"}
    # Only a matching pair of quotes goes; an empty chart dict (not a chart) is left out.
    assert messages.result_line({"text/plain": "'x\""}, False)["text"] == "'x\""
    assert "chart" not in messages.result_line({"e2b/chart": {}}, False)


def test_iopub_messages() -> None:
    date = datetime.datetime(2026, 1, 2, 3, 4, 5, tzinfo=datetime.UTC)
    stream = messages.iopub_line(
        {
            "header": {"msg_type": "stream", "date": date},
            "content": {"name": "stdout", "text": "hi"},
        }
    )
    assert stream == {"type": "stdout", "text": "hi", "timestamp": date.isoformat()}
    error = messages.iopub_line(
        {
            "header": {"msg_type": "error"},
            "content": {"ename": "E", "evalue": "v", "traceback": ["a", "b"]},
        }
    )
    count = messages.iopub_line(
        {"header": {"msg_type": "execute_input"}, "content": {"execution_count": 7}}
    )
    assert stream is not None and error is not None and count is not None
    ex = parsed(stream, error, count, messages.KEEPALIVE, messages.END)
    assert ex.logs.stdout == ["hi"] and ex.execution_count == 7
    assert ex.error is not None and (ex.error.name, ex.error.traceback) == ("E", "a\nb")
    assert messages.iopub_line({"header": {"msg_type": "status"}, "content": {}}) is None
