"""Path resolution and access checks for requests made on behalf of a user.

envd itself runs as root, so it checks the user's rights from the mode bits before it touches a
path for them; otherwise any sandbox user could read or overwrite anything through the API.
"""

from __future__ import annotations

import os
import stat

from .errors import InvalidArgument, NotFound, PermissionDenied
from .users import User

R, W, X = 4, 2, 1


def resolve(path: str, user: User) -> str:
    """Absolute, normalised path; `~` and relative paths start at the user's home.

    As upstream envd's `permissions.ExpandAndResolve`: `~user` forms are refused, and a relative
    path is joined to the home directory (not to the default workdir).
    """
    if not path:
        raise InvalidArgument("path is empty")
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


def permits(st: os.stat_result, user: User, want: int) -> bool:
    if user.is_root:
        return True
    mode = st.st_mode
    if st.st_uid == user.uid:
        bits = (mode >> 6) & 7
    elif st.st_gid in user.groups or st.st_gid == user.gid:
        bits = (mode >> 3) & 7
    else:
        bits = mode & 7
    return bits & want == want


def check_traverse(path: str, user: User) -> None:
    """The user may search every directory above `path`."""
    if user.is_root:
        return
    parent = os.path.dirname(path)
    parts = [p for p in parent.split("/") if p]
    current = "/"
    for part in [None, *parts]:
        if part is not None:
            current = os.path.join(current, part)
        try:
            st = os.stat(current)
        except FileNotFoundError:
            return
        if stat.S_ISDIR(st.st_mode) and not permits(st, user, X):
            raise PermissionDenied(f"permission denied: {user.name} cannot access {current}")


def check(path: str, user: User, want: int) -> os.stat_result:
    """Stat `path` (following links) and require `want` bits on it for the user."""
    check_traverse(path, user)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise NotFound(f"path not found: {path}") from None
    except NotADirectoryError:
        raise NotFound(f"path not found: {path} (a parent is not a directory)") from None
    if not permits(st, user, want):
        raise PermissionDenied(f"permission denied: {user.name} cannot access {path}")
    return st


def nearest_existing(path: str) -> tuple[str, os.stat_result]:
    """The deepest existing ancestor of `path` (or `path` itself), and its stat."""
    current = path
    while True:
        try:
            return current, os.stat(current)
        except (FileNotFoundError, NotADirectoryError):
            if current == "/":
                raise
            current = os.path.dirname(current)


def check_create(path: str, user: User) -> None:
    """The user may create `path`.

    Missing parent directories are no obstacle: like upstream envd (`permissions.EnsureDirs`)
    envd creates them and gives them to the user (`makedirs_as`), as long as the nearest
    existing ancestor is a directory the user can reach. An existing parent must be writable
    by the user, so the API cannot drop files into directories the user could not write.
    """
    parent = os.path.dirname(path)
    current, st = nearest_existing(parent)
    if not stat.S_ISDIR(st.st_mode):
        raise InvalidArgument(f"path is a file: {current} (cannot create {path} under it)")
    if user.is_root:
        return
    check_traverse(current + "/x", user)  # every directory down to `current`, itself included
    if current == parent and not permits(st, user, W | X):
        raise PermissionDenied(f"permission denied: {user.name} cannot write in {current}")


def check_write(path: str, user: User) -> None:
    """The user may write `path`, which exists or will be created."""
    try:
        st = os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        check_create(path, user)
        return
    check_traverse(path, user)
    if not permits(st, user, W):
        raise PermissionDenied(f"permission denied: {user.name} cannot write {path}")


def makedirs_as(path: str, user: User) -> None:
    """mkdir -p, giving every directory it creates to the user (upstream's EnsureDirs)."""
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


def check_dir(path: str, user: User) -> os.stat_result:
    """`path` is a directory the user may list."""
    st = check(path, user, 0)
    if not stat.S_ISDIR(st.st_mode):
        raise InvalidArgument(f"path is not a directory: {path}")
    if not permits(st, user, R | X):
        raise PermissionDenied(f"permission denied: {user.name} cannot list {path}")
    return st
