"""A real 3-member etcd on 127.0.0.1 for tests: free ports, a temp data dir per member, only
processes this harness started (killed by PID, none left behind).

    with EtcdCluster(tmp_path) as cluster:
        cluster.endpoints            # "127.0.0.1:p1,127.0.0.1:p2,127.0.0.1:p3"
        cluster.kill_leader()        # SIGKILL, returns the member's index
        cluster.restart(index)

Synchronous on purpose (subprocesses and urllib with timeouts): usable from module-scoped
fixtures that outlive any one test's event loop.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

ETCD = "/usr/bin/etcd"
HTTP_TIMEOUT_S = 2.0
READY_TIMEOUT_S = 30.0


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _all_threads_stopped(pid: int) -> bool:
    """Every task of `pid` in state T (stopped) per /proc; a gone process counts as stopped."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return True
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                stat = f.read()
        except FileNotFoundError:
            continue
        # The state follows the parenthesised command name, which may hold spaces.
        if stat.rsplit(")", 1)[1].split()[0] not in ("T", "t"):
            return False
    return True


@dataclass
class Member:
    index: int
    name: str
    client_port: int
    peer_port: int
    data_dir: Path
    log_path: Path
    process: subprocess.Popen[bytes] | None = None

    @property
    def client_url(self) -> str:
        return f"http://127.0.0.1:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"http://127.0.0.1:{self.peer_port}"

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def log_tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


def _post(url: str, body: dict[str, object]) -> dict[str, object]:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=HTTP_TIMEOUT_S) as response:
        result: dict[str, object] = json.loads(response.read())
        return result


# Starts made again when a picked port was taken meanwhile.
BIND_ATTEMPTS = 3


class EtcdCluster:
    def __init__(self, workdir: Path, size: int = 3) -> None:
        if not os.access(ETCD, os.X_OK):
            raise RuntimeError(
                f"{ETCD} is missing: these tests need a real etcd "
                "(`aenv setup --with-test-tools` installs Debian's etcd-server)"
            )
        self.workdir = workdir
        self.size = size
        self.token = f"agentenv-test-{uuid.uuid4().hex[:8]}"
        self.members = self._new_members()

    def _new_members(self) -> list[Member]:
        return [
            Member(
                index=i,
                name=f"m{i}",
                client_port=free_port(),
                peer_port=free_port(),
                data_dir=self.workdir / f"m{i}",
                log_path=self.workdir / f"m{i}.log",
            )
            for i in range(self.size)
        ]

    @property
    def endpoints(self) -> str:
        return ",".join(member.endpoint for member in self.members)

    def _command(self, member: Member) -> list[str]:
        initial = ",".join(f"{m.name}={m.peer_url}" for m in self.members)
        return [
            ETCD,
            "--name", member.name,
            "--data-dir", str(member.data_dir),
            "--listen-client-urls", member.client_url,
            "--advertise-client-urls", member.client_url,
            "--listen-peer-urls", member.peer_url,
            "--initial-advertise-peer-urls", member.peer_url,
            "--initial-cluster", initial,
            "--initial-cluster-token", self.token,
            "--initial-cluster-state", "new",
        ]  # fmt: skip

    def _spawn(self, member: Member) -> None:
        with member.log_path.open("ab") as log:
            member.process = subprocess.Popen(
                self._command(member),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )

    def start(self) -> EtcdCluster:
        """Up and healthy. A free port is only free when it was picked: another process may
        bind it before etcd does ("address already in use", seen once in a whole-suite CI
        run), so such a start is made again on new ports, a bounded number of times."""
        for attempt in range(1, BIND_ATTEMPTS + 1):
            self.workdir.mkdir(parents=True, exist_ok=True)
            try:
                for member in self.members:
                    self._spawn(member)
                self.wait_healthy()
                return self
            except BaseException as exc:
                self.stop()
                if attempt == BIND_ATTEMPTS or "address already in use" not in str(exc):
                    raise
                self.members = self._new_members()
        raise AssertionError("unreachable")

    def healthy(self, member: Member) -> bool:
        if not member.running:
            return False
        try:
            with urllib.request.urlopen(f"{member.client_url}/health", timeout=HTTP_TIMEOUT_S) as r:
                return bool(json.loads(r.read()).get("health") == "true")
        except (OSError, ValueError, urllib.error.URLError):
            return False

    def wait_healthy(self, timeout_s: float = READY_TIMEOUT_S) -> None:
        """Every running member answers /health with a leader (bounded)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for member in self.members:
                if member.process is not None and member.process.poll() is not None:
                    raise RuntimeError(
                        f"etcd {member.name} exited with {member.process.returncode}:\n"
                        f"{member.log_tail()}"
                    )
            if all(self.healthy(m) for m in self.members if m.process is not None):
                return
            time.sleep(0.1)
        tails = "\n".join(f"--- {m.name}\n{m.log_tail()}" for m in self.members)
        raise RuntimeError(f"etcd cluster not healthy within {timeout_s} s:\n{tails}")

    def status(self, member: Member) -> dict[str, object]:
        """etcd's maintenance status of one member (its id, the leader's id, raft term)."""
        return _post(f"{member.client_url}/v3/maintenance/status", {})

    def leader(self, timeout_s: float = 10.0) -> Member:
        """The member that says it is the leader (bounded wait through an election)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for member in self.members:
                if not member.running:
                    continue
                try:
                    status = self.status(member)
                except (OSError, ValueError):
                    continue
                header = status.get("header")
                own = header.get("member_id") if isinstance(header, dict) else None
                if own is not None and status.get("leader") == own:
                    return member
            time.sleep(0.1)
        raise RuntimeError(f"no etcd leader within {timeout_s} s")

    def kill(self, member: Member, sig: signal.Signals = signal.SIGKILL) -> None:
        process = member.process
        if process is None or process.poll() is not None:
            return
        process.send_signal(sig)
        if sig == signal.SIGKILL:
            process.wait(timeout=10)

    def kill_leader(self) -> Member:
        leader = self.leader()
        self.kill(leader)
        return leader

    def pause_all(self) -> None:
        """SIGSTOP every member: connections are accepted by the kernel, nothing answers.
        Returns once every thread of every member is stopped: the signal is sent at once,
        but each thread stops only when it next runs, and on a loaded host a member once
        answered a put sent right after (a whole-suite run)."""
        for member in self.members:
            self.kill(member, signal.SIGSTOP)
        deadline = time.monotonic() + READY_TIMEOUT_S
        for member in self.members:
            if member.process is None or member.process.poll() is not None:
                continue
            while not _all_threads_stopped(member.process.pid):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"etcd {member.name} did not stop on SIGSTOP")
                time.sleep(0.005)

    def resume_all(self) -> None:
        for member in self.members:
            if member.running:
                assert member.process is not None
                member.process.send_signal(signal.SIGCONT)

    def restart(self, member: Member, *, wait: bool = True) -> None:
        """Starts a stopped member again on its data dir (it rejoins as itself)."""
        self.kill(member)
        self._spawn(member)
        if wait:
            self.wait_healthy()

    def ensure_running(self) -> None:
        """Every member up and the cluster healthy: what a test that broke it leaves behind."""
        self.resume_all()
        for member in self.members:
            if not member.running:
                self._spawn(member)
        self.wait_healthy()

    def stop(self) -> None:
        for member in self.members:
            process = member.process
            if process is None:
                continue
            if process.poll() is None:
                process.send_signal(signal.SIGCONT)  # a stopped process cannot die of SIGKILL late
                process.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=10)
            member.process = None
        shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> EtcdCluster:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
