"""A data dir for tests and benches: `prepare_home` makes one with the `base` template
registered, as a copy of a seed data dir where one is set (`AGENTENV_SEED_HOME`). Node-side
(it reads and writes the layer store and snapshot repository's files): the API's test server
process (`api.devserver.ServerProcess`) only runs a server over a data dir made here."""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
import subprocess
import sys
from pathlib import Path

from agentenv.files import home_snapshots_dir

# A data dir that fresh ones start from (tests set it once per run): its `base` layer, its
# template snapshots and their layers are hard-linked, not rebuilt, so a new data dir costs
# neither the layer copy nor the cold boot and capture of its first sandbox.
SEED_ENV = "AGENTENV_SEED_HOME"


def prepare_home(home: Path, *, seeded: bool = True) -> Path:
    """Make ``home`` a data dir with the `base` template registered; its rootfs is built on
    first use and otherwise taken from the artifact cache (`AGENTENV_CACHE`). With
    `AGENTENV_SEED_HOME` set (and ``seeded``), a fresh ``home`` is a copy of that seed data
    dir (built on first use: `base` and its default-shape template snapshot) instead."""
    from dataclasses import replace

    from agentenv.config import Settings
    from agentenv.template.rootfs import ensure_base

    home.mkdir(parents=True, exist_ok=True)
    seed = os.environ.get(SEED_ENV)
    if seeded and seed and not any(home.iterdir()) and clone_home(ensure_seed(Path(seed)), home):
        return home
    ensure_base(replace(Settings.from_env(), home=home), None)
    return home


def ensure_seed(seed: Path) -> Path:
    """The seed data dir at ``seed``, built once (under a lock file, so concurrent test
    workers build it once between them) by `aenv setup`: `base` and its default-shape
    template snapshot, from the artifact cache."""
    done = seed / ".seeded"
    if done.exists():
        return seed
    seed.mkdir(parents=True, exist_ok=True)
    with (seed.parent / f".{seed.name}.lock").open("a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            env = {k: v for k, v in os.environ.items() if k != SEED_ENV}
            env["AGENTENV_HOME"] = str(seed)
            subprocess.run(
                [sys.executable, "-m", "agentenv.cli", "setup", "--skip-packages"],
                env=env,
                check=True,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                timeout=900,
            )
            done.touch()
    return seed


def _copy_holds(seed_store: Path, store: Path) -> None:
    """A store's holds (`storage.holds`: empty files), or the table a seed written before
    them has (read and turned into files by the store on its first use)."""
    from agentenv.storage.holds import HOLDS_DIR

    if (seed_store / HOLDS_DIR).is_dir():
        shutil.copytree(seed_store / HOLDS_DIR, store / HOLDS_DIR)
    legacy = seed_store / "refs.json"
    if legacy.exists():
        shutil.copy2(legacy, store / legacy.name)


def clone_home(seed: Path, home: Path) -> bool:
    """Fill the empty data dir ``home`` from ``seed``: layers, snapshot files and memory
    images hard-linked (all read-only, content-addressed), the catalogs copied. A layer
    with a parent is copied and re-pointed at ``home``'s copy of the parent (as a pulled
    layer is: it keeps its digest). False, with ``home`` left empty, where hard links
    cannot be made (another filesystem)."""
    from agentenv.storage import images

    made: list[Path] = []
    try:
        layers = home / "layers"
        layers.mkdir()
        made.append(layers)
        stacked = []
        for layer in sorted((seed / "layers").glob("*.qcow2")):
            if images.info(layer).backing_file is None:
                os.link(layer, layers / layer.name)
            else:
                stacked.append(layer)
        for layer in stacked:
            parent = images.info(layer).backing_file
            assert parent is not None
            copy = layers / layer.name
            shutil.copyfile(layer, copy)
            images.rebase_unsafe(copy, layers / parent.name)
            copy.chmod(0o444)
        _copy_holds(seed / "layers", layers)
        snapshots = home_snapshots_dir(home)
        snapshots.mkdir()
        made.append(snapshots)
        for entry in home_snapshots_dir(seed).iterdir():
            if entry.is_dir() and not entry.name.startswith("."):
                (snapshots / entry.name).mkdir()
                for f in entry.iterdir():
                    os.link(f, snapshots / entry.name / f.name)
        shutil.copy2(home_snapshots_dir(seed) / "catalog.json", snapshots / "catalog.json")
        _copy_holds(home_snapshots_dir(seed), snapshots)
        shutil.copy2(seed / "templates.json", home / "templates.json")
        made.append(home / "templates.json")
    except OSError as exc:
        if exc.errno != errno.EXDEV:
            raise
        for path in made:
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink(missing_ok=True)
        return False
    return True
