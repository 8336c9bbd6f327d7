"""Test images for image templates, made from what this host has (no internet, no docker).

* `busybox_image`: Debian's static busybox (``/bin/busybox`` from busybox-static) and its
  applet links, a root-only /etc/passwd, no libc at all; a second layer adds files and
  deletes one with a whiteout.
* `debian_image`: the ``base`` template's rootfs (debootstrap'd bookworm, glibc, bash, sudo,
  an existing ``user``) exported as one plain tar layer, plus a small app layer; Docker v2
  media types.

Both are pushed with `oci.images.Pusher` to a loopback registry (`oci.registry.Registry`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import httpx
from oci.images import Layer, Pushed, Pusher, sha

BUSYBOX = Path("/bin/busybox")
BUSYBOX_ENV = {
    "PATH": "/bin:/usr/bin",
    "GREETING": "hello world",
    "EQ": "a=b",
}
DEBIAN_ENV = {"PATH": "/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "APP_MODE": "test"}


def _applets() -> list[str]:
    out = subprocess.run(
        [str(BUSYBOX), "--list"], capture_output=True, text=True, check=True, timeout=30
    ).stdout
    return [a for a in out.split() if a and a != "busybox"]


def busybox_layers() -> list[tuple[bytes, str, str]]:
    if not BUSYBOX.is_file():
        raise RuntimeError("busybox-static is needed (/bin/busybox)")
    base = (
        Layer()
        .dir("bin").dir("etc").dir("root", 0o700)
        .file("bin/busybox", BUSYBOX.read_bytes(), 0o755)
        .file("etc/passwd", b"root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534::/:/bin/false\n")
        .file("etc/group", b"root:x:0:\nnogroup:x:65534:\n")
        .file("etc/old.txt", b"to be deleted\n")
    )  # fmt: skip
    for applet in _applets():
        base.symlink(f"bin/{applet}", "busybox")
    app = (
        Layer()
        .dir("app")
        .file("app/data.txt", b"from layer two\n")
        .whiteout("etc/old.txt")
        .file("etc/motd", b"busybox image\n")
    )
    return [base.blob("gzip"), app.blob("zstd")]


def push_busybox(pusher: Pusher, repo: str = "busybox", tag: str = "1") -> Pushed:
    return pusher.image(
        repo,
        tag,
        busybox_layers(),
        Env=[f"{k}={v}" for k, v in BUSYBOX_ENV.items()],
        WorkingDir="/app",
        Cmd=["sh"],
        ExposedPorts={"8080/tcp": {}},
    )


@contextlib.contextmanager
def exported_tree(qcow2: Path) -> Iterator[Path]:
    """The ext4 inside `qcow2`, loop-mounted read-only."""
    with tempfile.TemporaryDirectory(prefix="agentenv-export-", dir="/var/tmp") as tmp:
        raw = Path(tmp) / "fs.raw"
        mnt = Path(tmp) / "mnt"
        mnt.mkdir()
        subprocess.run(
            ["qemu-img", "convert", "-O", "raw", str(qcow2), str(raw)], check=True, timeout=600
        )
        subprocess.run(["mount", "-o", "loop,ro", str(raw), str(mnt)], check=True, timeout=60)
        try:
            yield mnt
        finally:
            subprocess.run(["umount", str(mnt)], check=True, timeout=60)


def tar_of(tree: Path, out: Path) -> str:
    """A plain tar of `tree` (numeric owners, xattrs); returns its sha256 digest."""
    subprocess.run(
        ["tar", "--numeric-owner", "--xattrs", "--xattrs-include=*", "--sort=name",
         "-C", str(tree), "-cf", str(out), "."],
        check=True, timeout=1800,
    )  # fmt: skip
    h = hashlib.sha256()
    with out.open("rb") as fh:
        while chunk := fh.read(1 << 20):
            h.update(chunk)
    return "sha256:" + h.hexdigest()


def upload_file(base_url: str, repo: str, path: Path, digest: str) -> None:
    """A monolithic blob upload streamed from a file (too big to hold as bytes twice)."""
    with httpx.Client(timeout=300.0) as http:
        if http.head(f"{base_url}/v2/{repo}/blobs/{digest}").status_code == 200:
            return
        r = http.post(f"{base_url}/v2/{repo}/blobs/uploads/")
        assert r.status_code == 202, r.text
        location = r.headers["location"]
        if location.startswith("/"):
            location = base_url + location
        sep = "&" if "?" in location else "?"
        with path.open("rb") as fh:
            r = http.put(
                f"{location}{sep}digest={digest}",
                content=fh,
                headers={
                    "Content-Type": "application/octet-stream",
                    "Content-Length": str(path.stat().st_size),
                },
            )
        assert r.status_code == 201, r.text


def push_debian(
    pusher: Pusher, base_layer: Path, workdir: Path, repo: str = "debian-app", tag: str = "1"
) -> Pushed:
    """The base template's rootfs as one layer, plus an app layer, in Docker v2 media types
    (whose layers are gzipped)."""
    tar = workdir / "debian.tar"
    with exported_tree(base_layer) as tree:
        diff_id = tar_of(tree, tar)
    gz = workdir / "debian.tar.gz"
    # pigz if the host has it; gzip -1 otherwise (the layer is a few hundred MB).
    zipper = ["pigz", "-1", "-c"] if shutil.which("pigz") else ["gzip", "-1", "-c"]
    with gz.open("wb") as out:
        subprocess.run([*zipper, str(tar)], stdout=out, check=True, timeout=1800)
    tar.unlink()
    h = hashlib.sha256()
    with gz.open("rb") as fh:
        while chunk := fh.read(1 << 20):
            h.update(chunk)
    blob_digest = "sha256:" + h.hexdigest()
    upload_file(pusher.base, repo, gz, blob_digest)
    app_blob, app_diff, _ = (
        Layer()
        .dir("app")
        .file("app/hello.py", b"print('hello from the image')\n", 0o755)
        .whiteout("etc/motd")
        .blob("gzip")
    )
    app_digest = pusher.blob(repo, app_blob)
    config = json.dumps(
        {
            "architecture": "amd64",
            "os": "linux",
            "config": {
                "Env": [f"{k}={v}" for k, v in DEBIAN_ENV.items()],
                "WorkingDir": "/app",
                "Cmd": ["python3", "/app/hello.py"],
            },
            "rootfs": {"type": "layers", "diff_ids": [diff_id, app_diff]},
        }
    ).encode()
    config_digest = pusher.blob(repo, config)
    layer = "application/vnd.docker.image.rootfs.diff.tar.gzip"
    manifest = json.dumps(
        {
            "schemaVersion": 2,
            "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
            "config": {
                "mediaType": "application/vnd.docker.container.image.v1+json",
                "digest": config_digest,
                "size": len(config),
            },
            "layers": [
                {"mediaType": layer, "digest": blob_digest, "size": gz.stat().st_size},
                {"mediaType": layer, "digest": app_digest, "size": len(app_blob)},
            ],
        }
    ).encode()
    digest = pusher.manifest(
        repo, tag, manifest, "application/vnd.docker.distribution.manifest.v2+json"
    )
    gz.unlink()
    return Pushed(repo, tag, digest, config_digest, [blob_digest, sha(app_blob)],
                  [diff_id, app_diff], [])  # fmt: skip
