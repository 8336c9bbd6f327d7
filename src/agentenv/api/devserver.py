"""Run `python -m agentenv.api` as a child process on a free loopback port (tests, benches)."""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType

import httpx

from agentenv.api.keys import key_file
from agentenv.files import home_snapshots_dir


class ServerStartError(RuntimeError):
    """The server process exited or did not answer /health in time."""


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
        shutil.copy2(seed / "layers" / "refs.json", layers / "refs.json")
        snapshots = home_snapshots_dir(home)
        snapshots.mkdir()
        made.append(snapshots)
        for entry in home_snapshots_dir(seed).iterdir():
            if entry.is_dir() and not entry.name.startswith("."):
                (snapshots / entry.name).mkdir()
                for f in entry.iterdir():
                    os.link(f, snapshots / entry.name / f.name)
        shutil.copy2(home_snapshots_dir(seed) / "catalog.json", snapshots / "catalog.json")
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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class OwnProcess:
    """A process a test or benchmark started (`proc`), its log in `log_path`: stopped with
    SIGTERM (SIGKILL past the timeout) or crashed with SIGKILL, by its PID only."""

    proc: subprocess.Popen[bytes] | None
    log_path: Path

    def stop(self, timeout_s: float = 60.0) -> int | None:
        if self.proc is None:
            return None
        proc, self.proc = self.proc, None
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        return proc.returncode

    def crash(self) -> None:
        """SIGKILL it (no shutdown runs: its VMs stay, as after a crash)."""
        if self.proc is None:
            return
        proc, self.proc = self.proc, None
        proc.kill()
        proc.wait()

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


class ServerProcess(OwnProcess):
    def __init__(
        self,
        home: Path,
        *,
        port: int | None = None,
        domain: str | None = None,
        env: dict[str, str] | None = None,
        tls: tuple[Path, Path] | None = None,
        log_path: Path | None = None,
        ready_timeout_s: float = 60.0,
    ) -> None:
        self.home = home
        self.port = port or free_port()
        self.domain = domain
        self.env = env or {}
        self.tls = tls
        self.log_path = log_path or home / "server.log"
        self.ready_timeout_s = ready_timeout_s
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        scheme = "https" if self.tls else "http"
        return f"{scheme}://127.0.0.1:{self.port}"

    @property
    def api_key(self) -> str:
        return key_file(self.home).read_text().strip()

    def sdk_env(self) -> dict[str, str]:
        return {
            "E2B_API_URL": self.url,
            "E2B_SANDBOX_URL": self.url,
            "E2B_API_KEY": self.api_key,
        }

    def start(self) -> ServerProcess:
        self.home.mkdir(parents=True, exist_ok=True)
        args = [sys.executable, "-m", "agentenv.api", "--host", "127.0.0.1"]
        args += ["--port", str(self.port)]
        if self.domain:
            args += ["--domain", self.domain]
        if self.tls:
            args += ["--cert", str(self.tls[0]), "--key", str(self.tls[1])]
        env = {**os.environ, "AGENTENV_HOME": str(self.home), **self.env}
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                args, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )
        deadline = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerStartError(
                    f"server exited with {self.proc.returncode}: {self.log_tail()}"
                )
            try:
                # Readiness only: the TLS certificate is checked by the caller's own requests.
                ok = httpx.get(f"{self.url}/health", timeout=1.0, verify=False)
                if ok.status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        self.stop()
        raise ServerStartError(f"server not ready in {self.ready_timeout_s:.0f} s")

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
