"""Named crash points, for tests of crash recovery.

A real server killed by SIGKILL at a random moment rarely stops inside the few milliseconds
between two steps of a pause or a fork. `AGENTENV_CRASH_AT=<point>` makes the process kill
itself with SIGKILL the first time it reaches that point, so a test can stop it exactly
between two steps and check that the next server rolls the operation forward or back. Unset
(always, outside tests), `crash_point` costs one dictionary lookup.
"""

from __future__ import annotations

import os
import signal

ENV = "AGENTENV_CRASH_AT"

# Every point the code marks, so a test names only real ones.
POINTS = frozenset(
    {
        "pause:saved",  # state written, paused record not yet
        "pause:recorded",  # paused record written, QEMU still alive
        "resume:loaded",  # state loaded into the new QEMU, guest not yet running
        "resume:running",  # guest running, paused record gone, envd not checked
        "fspause:stopped",  # filesystem-only pause: guest synced and stopped, no record
        "fspause:recorded",  # its record written, the stopped QEMU still alive
        "coldboot:booting",  # resume by a cold boot: QEMU spawned, record kept, guest booting
        "coldboot:running",  # envd answered, record removed, the control plane not told
        "capture:sealed",  # guest stopped, disk sealed, nothing saved
        "fork:captured",  # fork snapshot committed, no child restored
        "fork:child",  # first child restored, others not
        "template:booted",  # template build VM booted, not captured
        "create:relocated",  # a create took a warm entry: moved into the sandboxes dir, no state
        "create:acquired",  # a create holds its workdir, layer reference, slot; no QEMU yet
        "create:loaded",  # a create's restored guest runs its state, not yet given its identity
        "create:restored",  # a create's guest runs, the control plane not told
        "delete:vm-gone",  # a delete's QEMU step ran (process, jail, cgroup, VM record gone);
        # its slot, references and workdir are still held
        "control:pausing",  # the control plane's row says pausing, the runtime not asked
        "reset:deleted",  # a reset deleted the old guest, the saved state not started yet
    }
)


def crash_point(name: str) -> None:
    """SIGKILL this process if `AGENTENV_CRASH_AT` names this point."""
    if os.environ.get(ENV) == name:
        if name not in POINTS:
            raise ValueError(f"unknown crash point {name!r}")
        os.kill(os.getpid(), signal.SIGKILL)
