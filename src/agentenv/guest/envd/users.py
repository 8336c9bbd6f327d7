"""Who a request acts as: the `Authorization: Basic base64("user:")` user or the default one."""

from __future__ import annotations

import base64
import binascii
import grp
import os
import pwd
from dataclasses import dataclass

from .errors import Unauthenticated

DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


@dataclass(frozen=True)
class User:
    name: str
    uid: int
    gid: int
    groups: tuple[int, ...]
    home: str
    shell: str

    @property
    def is_root(self) -> bool:
        return self.uid == 0

    def login_env(self) -> dict[str, str]:
        """The variables a login would set, before the sandbox's and the request's own."""
        return {
            "PATH": DEFAULT_PATH,
            "HOME": self.home,
            "USER": self.name,
            "LOGNAME": self.name,
            "SHELL": self.shell,
        }


def lookup_user(name: str) -> User:
    try:
        pw = pwd.getpwnam(name)
    except KeyError:
        raise Unauthenticated(f"invalid user: {name!r} does not exist") from None
    groups = tuple(sorted(set(os.getgrouplist(pw.pw_name, pw.pw_gid))))
    return User(
        name=pw.pw_name,
        uid=pw.pw_uid,
        gid=pw.pw_gid,
        groups=groups,
        home=pw.pw_dir or "/",
        shell=pw.pw_shell or "/bin/sh",
    )


def user_from_authorization(header: str | None) -> str | None:
    """The user name in a Basic authorization header (the SDK sends an empty password)."""
    if not header:
        return None
    scheme, _, value = header.partition(" ")
    if scheme.lower() != "basic":
        raise Unauthenticated(f"unsupported authorization scheme {scheme!r}")
    try:
        decoded = base64.b64decode(value.strip(), validate=True).decode()
    except (binascii.Error, UnicodeDecodeError):
        raise Unauthenticated("malformed basic authorization header") from None
    name = decoded.partition(":")[0]
    return name or None


def group_name(gid: int) -> str:
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return str(gid)


def user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)
