"""Path expansion and directory creation for the user a request names.

envd runs as root and, like upstream envd, does every file operation as root. The user a request
names decides two things only: where `~` and relative paths start, and who owns the files and
directories a request creates. No operation is refused because of that user's permission bits:
whoever can call envd can just as well name `root`, so such a check protects nothing, and it
broke calls that work on E2B (`make_dir("/workspace")` as the default user). docs/envd-files.md
lists what each operation does.
"""

from __future__ import annotations

import os

from .errors import InvalidArgument
from .users import User


def resolve(path: str, user: User, workdir: str | None = None) -> str:
    """Absolute, normalised path; `~` and relative paths start at the user's home.

    As upstream envd's `permissions.ExpandAndResolve`: an empty path means the default workdir
    (or the home directory without one), `~user` forms are refused, and a relative path is
    joined to the home directory (not to the default workdir).
    """
    if not path:
        path = workdir or user.home
    if "\x00" in path:
        raise InvalidArgument("path contains a NUL byte")
    if path.startswith("~"):
        if len(path) > 1 and path[1] != "/":
            raise InvalidArgument(
                f"failed to expand path {path!r} for user {user.name!r}: "
                "cannot expand user-specific home dir"
            )
        path = user.home + path[1:]
    if not os.path.isabs(path):
        path = os.path.join(user.home, path)
    return os.path.normpath(path)


def resolve_cwd(cwd: str | None, user: User) -> str:
    """A process's working directory: empty means the home directory, else as `resolve`."""
    return resolve(cwd, user) if cwd else os.path.normpath(user.home)


def makedirs_as(path: str, user: User) -> None:
    """mkdir -p as root, giving every directory it creates to the user (upstream's EnsureDirs).

    Directories that already exist keep their owner and mode, whoever may write them. A
    component that exists and is not a directory is the caller's mistake (400 here; upstream
    answers 500 for it).
    """
    missing: list[str] = []
    current = path
    while not os.path.lexists(current):
        missing.append(current)
        current = os.path.dirname(current)
    if not os.path.isdir(current):
        raise InvalidArgument(f"path is a file: {current}")
    for directory in reversed(missing):
        try:
            os.mkdir(directory, 0o755)
        except FileExistsError:
            # Made meanwhile by someone else, who keeps it.
            if not os.path.isdir(directory):
                raise InvalidArgument(f"path is a file: {directory}") from None
            continue
        if os.geteuid() == 0:
            os.chown(directory, user.uid, user.gid)
