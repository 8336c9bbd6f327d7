"""The C library for envd's few direct calls (clock_settime, inotify), loaded once and without a
search: `ctypes.util.find_library` runs `ldconfig -p` (then gcc, ld) in a child process on every
call, and `/init` runs once per create, reset and fork child, in a guest that under TCG pays
dearly for a fork of envd's Python process."""

from __future__ import annotations

import ctypes
import functools


@functools.cache
def libc() -> ctypes.CDLL:
    # dlopen(NULL): the symbols of the process and its libraries, libc among them.
    lib = ctypes.CDLL(None, use_errno=True)
    if hasattr(lib, "clock_settime") and hasattr(lib, "inotify_init1"):
        return lib
    return ctypes.CDLL("libc.so.6", use_errno=True)
