"""The preload library that keeps a clone's freed pages off its template's memory file.

QEMU discards freed guest pages of file-backed RAM by punching holes into the file, also when
the file is mapped private (7.2 silently; 8.1+ with a warning; a read-only file makes it fail
instead, so nothing is returned to the host). A clone's RAM is a private mapping of the
template snapshot every other clone maps, so QEMU on its own can either corrupt the template
or keep every page a clone ever touched. `files/ramshim.c` turns the punch on that one file
into a no-op; QEMU's own madvise that follows drops the clone's private copies.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from agentenv.template.cache import ArtifactCache, digest_files
from agentenv.template.commands import run
from agentenv.template.errors import BuildError
from agentenv.template.hostfacts import tool_version
from agentenv.template.progress import ProgressFn, report

SOURCE = Path(__file__).parent / "files" / "ramshim.c"
LIBRARY = "ramshim.so"
KIND = "ramshim"
# The snapshot memory file the library guards, passed in QEMU's environment.
ENV_VAR = "AGENTENV_PRIVATE_RAM"
CC = "cc"


def compiler_version(cc: str = CC) -> str:
    return tool_version(cc) or ""


def shim_inputs(cc: str = CC) -> dict[str, str]:
    return {"source": digest_files(SOURCE), "cc": compiler_version(cc)}


def find_ram_shim(cache: Path) -> Path | None:
    """The built library for the current source, or None (`ensure_ram_shim` builds it)."""
    found = ArtifactCache(cache).lookup(KIND, shim_inputs())
    return None if found is None else found / LIBRARY


def ensure_ram_shim(cache: Path, progress: ProgressFn | None = None) -> Path:
    if shutil.which(CC) is None:
        raise BuildError(
            "building the RAM preload library needs a C compiler: run `aenv setup` "
            "(it installs gcc and libc6-dev)"
        )

    def build(out: Path) -> None:
        report(progress, "building the RAM preload library")
        flags = ["-shared", "-fPIC", "-O2", "-Wall", "-Wextra", "-Werror"]
        run([CC, *flags, "-o", str(out / LIBRARY), str(SOURCE), "-ldl"])

    path, _ = ArtifactCache(cache).ensure(KIND, shim_inputs(), build)
    return path / LIBRARY


def preload_env(shim: Path, mem_file: Path) -> dict[str, str]:
    """The environment that loads the library into exactly one process: QEMU (the library
    removes itself from the environment of anything QEMU starts)."""
    return {"LD_PRELOAD": str(shim), ENV_VAR: str(mem_file)}
