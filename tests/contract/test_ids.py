"""The sandbox id's one definition: what the control plane makes, the node accepts."""

from __future__ import annotations

import pytest

from agentenv.contract.ids import SANDBOX_ID_LEN, is_sandbox_id, new_sandbox_id


def test_new_ids_are_ids_and_differ() -> None:
    made = {new_sandbox_id() for _ in range(200)}
    assert len(made) == 200
    assert all(is_sandbox_id(i) and len(i) == SANDBOX_ID_LEN for i in made)


@pytest.mark.parametrize(
    "value",
    ["", "i", "x" + "a" * 19, "i" + "A" * 19, "i" + "a" * 18, "i" + "a" * 20, "i" + "a" * 18 + "-",
     "i" + "a" * 18 + "."],
)  # fmt: skip
def test_what_is_not_an_id(value: str) -> None:
    assert not is_sandbox_id(value)
