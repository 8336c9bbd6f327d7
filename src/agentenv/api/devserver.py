"""Run `python -m agentenv.api` as a child process on a free loopback port (tests, benches)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType

import httpx

from agentenv.api.keys import key_file


class ServerStartError(RuntimeError):
    """The server process exited or did not answer /health in time."""


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
