"""Test images made in Python: layer archives with every entry type, and a small pusher.

`Layer` builds a tar (PAX format, so xattrs travel as ``SCHILY.xattr.*``) and compresses it;
`Pusher` uploads blobs (monolithic POST+PUT) and manifests through the distribution API.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import tarfile
from dataclasses import dataclass, field

import httpx
import zstandard

from agentenv.oci import manifest as mf

MTIME = 1_700_000_000


def sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


@dataclass
class Layer:
    entries: list[tuple[tarfile.TarInfo, bytes | None]] = field(default_factory=list)

    def _info(self, name: str, kind: bytes, mode: int, uid: int, gid: int) -> tarfile.TarInfo:
        ti = tarfile.TarInfo(name)
        ti.type = kind
        ti.mode = mode
        ti.uid = uid
        ti.gid = gid
        ti.mtime = MTIME
        return ti

    def dir(self, name: str, mode: int = 0o755, uid: int = 0, gid: int = 0) -> Layer:
        self.entries.append((self._info(name, tarfile.DIRTYPE, mode, uid, gid), None))
        return self

    def file(
        self,
        name: str,
        data: bytes,
        mode: int = 0o644,
        uid: int = 0,
        gid: int = 0,
        xattrs: dict[str, str] | None = None,
        mtime: int = MTIME,
    ) -> Layer:
        ti = self._info(name, tarfile.REGTYPE, mode, uid, gid)
        ti.size = len(data)
        ti.mtime = mtime
        for k, v in (xattrs or {}).items():
            ti.pax_headers[f"SCHILY.xattr.{k}"] = v
        self.entries.append((ti, data))
        return self

    def symlink(self, name: str, target: str, uid: int = 0, gid: int = 0) -> Layer:
        ti = self._info(name, tarfile.SYMTYPE, 0o777, uid, gid)
        ti.linkname = target
        self.entries.append((ti, None))
        return self

    def hardlink(self, name: str, target: str) -> Layer:
        ti = self._info(name, tarfile.LNKTYPE, 0o644, 0, 0)
        ti.linkname = target
        self.entries.append((ti, None))
        return self

    def device(self, name: str, char: bool, major: int, minor: int, mode: int = 0o666) -> Layer:
        ti = self._info(name, tarfile.CHRTYPE if char else tarfile.BLKTYPE, mode, 0, 0)
        ti.devmajor = major
        ti.devminor = minor
        self.entries.append((ti, None))
        return self

    def fifo(self, name: str, mode: int = 0o600) -> Layer:
        self.entries.append((self._info(name, tarfile.FIFOTYPE, mode, 0, 0), None))
        return self

    def whiteout(self, name: str) -> Layer:
        head, _, base = name.rpartition("/")
        return self.file(f"{head}/.wh.{base}" if head else f".wh.{base}", b"")

    def opaque(self, directory: str) -> Layer:
        return self.file(f"{directory}/.wh..wh..opq", b"")

    def tar(self) -> bytes:
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
            for ti, data in self.entries:
                tf.addfile(ti, io.BytesIO(data) if data is not None else None)
        return buf.getvalue()

    def blob(self, compression: str = "gzip") -> tuple[bytes, str, str]:
        """(compressed bytes, diffID, media type)."""
        raw = self.tar()
        if compression == "gzip":
            return (
                gzip.compress(raw, mtime=0),
                sha(raw),
                "application/vnd.oci.image.layer.v1.tar+gzip",
            )
        if compression == "zstd":
            data = zstandard.ZstdCompressor().compress(raw)
            return data, sha(raw), "application/vnd.oci.image.layer.v1.tar+zstd"
        return raw, sha(raw), "application/vnd.oci.image.layer.v1.tar"


DOCKER_LAYER = "application/vnd.docker.image.rootfs.diff.tar.gzip"


def image_config(diff_ids: list[str], arch: str = "amd64", **cfg: object) -> bytes:
    return json.dumps(
        {
            "architecture": arch,
            "os": "linux",
            "config": cfg,
            "rootfs": {"type": "layers", "diff_ids": diff_ids},
        }
    ).encode()


@dataclass
class Pushed:
    repo: str
    tag: str
    manifest_digest: str
    config_digest: str
    layer_digests: list[str]
    diff_ids: list[str]
    layer_bytes: list[bytes]


class Pusher:
    def __init__(self, base_url: str) -> None:
        self.base = base_url
        self.http = httpx.Client(timeout=30.0)

    def close(self) -> None:
        self.http.close()

    def blob(self, repo: str, data: bytes) -> str:
        digest = sha(data)
        if self.http.head(f"{self.base}/v2/{repo}/blobs/{digest}").status_code == 200:
            return digest
        r = self.http.post(f"{self.base}/v2/{repo}/blobs/uploads/")
        assert r.status_code == 202, r.text
        location = r.headers["location"]
        if location.startswith("/"):
            location = self.base + location
        sep = "&" if "?" in location else "?"
        r = self.http.put(
            f"{location}{sep}digest={digest}",
            content=data,
            headers={"Content-Type": "application/octet-stream"},
        )
        assert r.status_code == 201, r.text
        return digest

    def manifest(self, repo: str, ref: str, body: bytes, media_type: str) -> str:
        r = self.http.put(
            f"{self.base}/v2/{repo}/manifests/{ref}",
            content=body,
            headers={"Content-Type": media_type},
        )
        assert r.status_code == 201, r.text
        return sha(body)

    def image(
        self,
        repo: str,
        tag: str,
        layers: list[tuple[bytes, str, str]],
        *,
        docker: bool = False,
        arch: str = "amd64",
        sizes: dict[int, int] | None = None,
        push_tag: bool = True,
        **cfg: object,
    ) -> Pushed:
        """Push layers + config + manifest; `sizes` overrides descriptor sizes (to lie)."""
        diff_ids = [d for _, d, _ in layers]
        config = image_config(diff_ids, arch, **cfg)
        config_digest = self.blob(repo, config)
        descs = []
        for i, (data, _, media_type) in enumerate(layers):
            digest = self.blob(repo, data)
            size = (sizes or {}).get(i, len(data))
            descs.append({"mediaType": DOCKER_LAYER if docker else media_type,
                          "digest": digest, "size": size})  # fmt: skip
        media_type = mf.DOCKER_MANIFEST if docker else mf.OCI_MANIFEST
        body = json.dumps(
            {
                "schemaVersion": 2,
                "mediaType": media_type,
                "config": {
                    "mediaType": mf.DOCKER_CONFIG if docker else mf.OCI_CONFIG,
                    "digest": config_digest,
                    "size": len(config),
                },
                "layers": descs,
            }
        ).encode()
        digest = self.manifest(repo, tag if push_tag else sha(body), body, media_type)
        return Pushed(repo, tag, digest, config_digest, [sha(d) for d, _, _ in layers],
                      diff_ids, [d for d, _, _ in layers])  # fmt: skip

    def index(
        self, repo: str, tag: str, entries: list[tuple[Pushed, str]], docker: bool = False
    ) -> str:
        media_type = mf.DOCKER_LIST if docker else mf.OCI_INDEX
        inner = mf.DOCKER_MANIFEST if docker else mf.OCI_MANIFEST
        manifests = []
        for pushed, arch in entries:
            r = self.http.get(
                f"{self.base}/v2/{pushed.repo}/manifests/{pushed.manifest_digest}",
                headers={"Accept": inner},
            )
            manifests.append({"mediaType": inner, "digest": pushed.manifest_digest,
                              "size": len(r.content),
                              "platform": {"os": "linux", "architecture": arch}})  # fmt: skip
        body = json.dumps({"schemaVersion": 2, "mediaType": media_type, "manifests": manifests})
        return self.manifest(repo, tag, body.encode(), media_type)
