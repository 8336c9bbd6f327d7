"""A sandbox's id: the one name it has from the API to the VM.

The control plane chooses it (`new_sandbox_id`); the node runs the sandbox under it (its
directory, its VM, its guest's hostname) and refuses an id that is not one (`is_sandbox_id`).
Lowercase letters and digits only: the id is a DNS label in `{port}-{id}.{domain}`.
"""

from __future__ import annotations

import secrets
import string

_ALPHABET = string.ascii_lowercase + string.digits
# "i" and 19 letters or digits, as E2B's sandbox ids.
SANDBOX_ID_LEN = 20


def new_sandbox_id() -> str:
    return "i" + "".join(secrets.choice(_ALPHABET) for _ in range(SANDBOX_ID_LEN - 1))


def is_sandbox_id(value: str) -> bool:
    return (
        len(value) == SANDBOX_ID_LEN and value[0] == "i" and all(c in _ALPHABET for c in value[1:])
    )
