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
    """Absolute, normalised path; `~` and relative paths start at the user's home."""
    if not path:
        raise InvalidArgument("path is empty")
    if "\x00" in path:
        raise InvalidArgument("path contains a NUL byte")
    if path == "~" or path.startswith("~/"):
        path = user.home + path[1:]
    if not os.path.isabs(path):
        path = os.path.join(user.home, path)
    return os.path.normpath(path)


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


def check_create(path: str, user: User) -> None:
    """The user may create `path`: write and search on its nearest existing ancestor."""
    if user.is_root:
        return
    current = os.path.dirname(path)
    while True:
        try:
            st = os.stat(current)
            break
        except FileNotFoundError:
            current = os.path.dirname(current)
    check_traverse(current + "/x", user)
    if not stat.S_ISDIR(st.st_mode):
        raise InvalidArgument(f"{current} is not a directory")
    if not permits(st, user, W | X):
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
    """mkdir -p, giving every directory it creates to the user."""
    missing: list[str] = []
    current = path
    while not os.path.lexists(current):
        missing.append(current)
        current = os.path.dirname(current)
    if os.path.lexists(current) and not os.path.isdir(current):
        raise InvalidArgument(f"{current} is not a directory")
    for directory in reversed(missing):
        try:
            os.mkdir(directory, 0o755)
        except FileExistsError:
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
