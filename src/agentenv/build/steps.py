"""The pure parts of a template build's steps: the context ENV/ARG/USER/WORKDIR leave for
later steps, how a step is named in the log and in the step cache, and the shell scripts that
WORKDIR and COPY run in the build sandbox (`builder.Builder` runs them)."""

from __future__ import annotations

import os
import shlex
from dataclasses import dataclass, field

from agentenv.build.spec import Step

# E2B's sandbox defaults, also where a build starts: steps run as `user` in its home.
DEFAULT_USER = "user"
DEFAULT_WORKDIR = "/home/user"


class StepFailed(Exception):
    def __init__(self, step: str, message: str) -> None:
        super().__init__(message)
        self.step = step
        self.message = message


@dataclass
class Context:
    """What ENV/ARG/USER/WORKDIR steps leave for the steps after them."""

    envs: dict[str, str] = field(default_factory=dict)
    user: str = DEFAULT_USER
    workdir: str = DEFAULT_WORKDIR

    def apply(self, step: Step) -> None:
        if step.type in ("ENV", "ARG"):
            for i in range(0, len(step.args), 2):
                self.envs[step.args[i]] = step.args[i + 1]
        elif step.type == "USER":
            self.user = step.args[0]
        elif step.type == "WORKDIR":
            self.workdir = join_path(self.workdir, step.args[0])


def join_path(base: str, path: str) -> str:
    return os.path.normpath(path if path.startswith("/") else os.path.join(base, path))


def cache_name(key: str) -> str:
    """A snapshot name for a step key (snapshot names allow 63 characters)."""
    return f"build-cache-{key[:40]}"


def final_name(key: str) -> str:
    return f"build-final-{key[:40]}"


def workdir_script(path: str, user: str) -> str:
    """WORKDIR makes a missing directory owned by the current USER, as E2B's (which runs
    `mkdir -p` as that user) leaves it; made as root and handed over, so a path the user
    could not create (`/app`) works too instead of failing the build."""
    owner = user if ":" in user else f"{user}:"  # USER may name the group too
    d, o = shlex.quote(path), shlex.quote(owner)
    return f"[ -d {d} ] || {{ mkdir -p {d} && chown {o} {d}; }}"


def describe(step: Step) -> str:
    if step.type == "RUN":
        text = step.args[0] + (f" (as {step.args[1]})" if len(step.args) > 1 else "")
    elif step.type in ("ENV", "ARG"):
        text = " ".join(f"{step.args[i]}={step.args[i + 1]}" for i in range(0, len(step.args), 2))
    else:
        text = " ".join(a for a in step.args if a)
    return f"{step.type} {text}"


def copy_script(src: str, dest: str, owner: str, mode: str, staging: str) -> str:
    """The shell that puts an uploaded COPY archive in place with the SDK's meaning: paths in
    the archive are relative to the build context; a directory source copies its contents
    into `dest`, a file goes into `dest/` when `dest` ends with `/` (or is a directory) and
    becomes `dest` otherwise; several matches (a glob) need `dest` to be a directory."""
    q = shlex.quote
    src_rel = src
    while src_rel.startswith("./"):
        src_rel = src_rel[2:]
    src_rel = src_rel.lstrip("/") or "."
    lines = [
        "set -e",
        f"S={q(staging)}",
        f"D={q(dest)}",
        'rm -rf "$S.d" && mkdir -p "$S.d"',
        'tar -xzf "$S" -C "$S.d" 2>/dev/null || tar -xf "$S" -C "$S.d"',
        'cd "$S.d"',
        f"set -- {src_rel}" if any(c in src_rel for c in "*?[") else f"set -- {q(src_rel)}",
        'if [ "$#" -eq 1 ] && [ ! -e "$1" ]; then echo "COPY: no file matches $1" >&2; exit 1; fi',
        'many=0; [ "$#" -gt 1 ] && many=1',
        'case "$D" in */) dir=1 ;; *) dir=0 ;; esac',
        '[ -d "$D" ] && dir=1',
        'made=""',
        'for f in "$@"; do',
        '  if [ -d "$f" ] && [ "$many" -eq 0 ]; then',
        '    mkdir -p "$D"; cp -a "$f"/. "$D"/; made="$made $D"',
        '  elif [ "$dir" -eq 1 ] || [ "$many" -eq 1 ]; then',
        '    mkdir -p "$D"; b=$(basename "$f"); cp -a "$f" "$D/$b"; made="$made $D/$b"',
        "  else",
        '    mkdir -p "$(dirname "$D")"; cp -a "$f" "$D"; made="$made $D"',
        "  fi",
        "done",
    ]
    if owner:
        lines.append(f'for m in $made; do chown -R {q(owner)} "$m"; done')
    if mode:
        lines.append(f'for m in $made; do chmod -R {q(mode)} "$m"; done')
    lines.append('cd / && rm -rf "$S" "$S.d"')
    return "\n".join(lines)
