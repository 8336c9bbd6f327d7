"""A client for the OCI distribution API (what `docker pull` speaks), over httpx.

`RegistryClient.resolve(ref)` fetches the manifest a reference names (an index or Docker
manifest list is resolved to linux/amd64) and checks its digest; `fetch_blob` downloads a
blob into the `ImageCache`, checking digest and size. Downloads of one blob are serialised by
a per-blob file lock (so concurrent pulls of one image download each layer once, also across
processes), resume from the ``.partial`` file with an HTTP Range request after a cut, and at
most `RegistryConfig.max_downloads` run at once per client.

Endpoints: a registry's mirrors are tried first, in order, then the registry itself; a mirror
that fails or lacks the content is skipped. Plain HTTP is used for registries on a loopback
address (as Docker does) and for those listed as insecure; everything else is HTTPS. Every
request has a timeout (connect, read, write and pool; manifests also an overall deadline).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from agentenv.filelock import file_lock
from agentenv.oci import manifest as mf
from agentenv.oci.auth import Authenticator, Credentials
from agentenv.oci.cache import ImageCache
from agentenv.oci.errors import (
    BlobUnknown,
    DigestMismatch,
    ManifestUnknown,
    OciError,
    RegistryError,
    SizeMismatch,
    Unauthorized,
)
from agentenv.oci.reference import Reference

MAX_MANIFEST_BYTES = 4 * 1024 * 1024
CHUNK = 1024 * 1024
DOWNLOAD_LOCK_TIMEOUT_S = 3600.0

ProgressFn = Callable[[str, int, int], None]


def _split_list(raw: str) -> list[str]:
    return [x.strip() for x in raw.replace(";", ",").split(",") if x.strip()]


@dataclass(frozen=True)
class RegistryConfig:
    """How to reach registries. `mirrors` maps a registry (``docker.io``, ``host:port``) to
    mirror bases (``https://mirror.example``, or ``host:port`` with the usual scheme rule)."""

    mirrors: dict[str, tuple[str, ...]] = field(default_factory=dict)
    insecure: frozenset[str] = frozenset()
    credentials: dict[str, Credentials] = field(default_factory=dict)
    max_downloads: int = 3
    timeout_s: float = 30.0
    attempts: int = 3
    verify: str | bool = True

    @classmethod
    def from_env(cls, credentials: dict[str, Credentials] | None = None) -> RegistryConfig:
        """``AGENTENV_REGISTRY_MIRRORS`` (``docker.io=https://m1|https://m2,host:5000=…``),
        ``AGENTENV_INSECURE_REGISTRIES`` (``host:5000,other``), ``AGENTENV_PULL_CONCURRENCY``."""
        mirrors: dict[str, tuple[str, ...]] = {}
        for item in _split_list(os.environ.get("AGENTENV_REGISTRY_MIRRORS", "")):
            registry, sep, bases = item.partition("=")
            if not sep or not bases:
                raise OciError(f"AGENTENV_REGISTRY_MIRRORS: {item!r} is not registry=mirror")
            mirrors[registry.strip()] = tuple(b.strip() for b in bases.split("|") if b.strip())
        insecure = frozenset(_split_list(os.environ.get("AGENTENV_INSECURE_REGISTRIES", "")))
        raw = os.environ.get("AGENTENV_PULL_CONCURRENCY", "3")
        try:
            concurrency = max(1, int(raw))
        except ValueError:
            raise OciError(f"AGENTENV_PULL_CONCURRENCY={raw!r} is not a number") from None
        return cls(mirrors, insecure, dict(credentials or {}), concurrency)


@dataclass(frozen=True)
class Endpoint:
    base: str  # scheme://host[:port]
    host: str  # host[:port]: the key for credentials and tokens
    mirror: bool


@dataclass(frozen=True)
class Resolved:
    reference: Reference  # with the digest of the image manifest
    manifest_digest: str
    manifest: mf.ImageManifest
    manifest_bytes: bytes
    index_digest: str | None = None
    index_bytes: bytes | None = None


@dataclass
class Stats:
    manifest_requests: int = 0
    blob_requests: int = 0
    range_requests: int = 0
    bytes_downloaded: int = 0
    blobs_fetched: int = 0
    blob_hits: int = 0


class _Retry(Exception):
    """A download attempt that should be made again (counts against the attempts)."""


def _is_loopback_host(host: str) -> bool:
    return Reference(host, "x").is_loopback


def _resume_offset(partial: Path, size: int) -> int:
    """Bytes of a kept partial download to resume from (0 if none or unusable)."""
    try:
        have = partial.stat().st_size
    except FileNotFoundError:
        return 0
    if have > size:
        partial.unlink()
        return 0
    return have


def _sha256_file(path: Path) -> str:
    with path.open("rb") as fh:
        return "sha256:" + hashlib.file_digest(fh, "sha256").hexdigest()


class RegistryClient:
    def __init__(self, config: RegistryConfig | None = None, cache: ImageCache | None = None):
        self.config = config or RegistryConfig()
        self.cache = cache
        self.auth = Authenticator(self.config.credentials)
        self.stats = Stats()
        t = self.config.timeout_s
        self._http = httpx.AsyncClient(
            timeout=httpx.Timeout(t, connect=min(t, 10.0)),
            follow_redirects=True,  # httpx drops Authorization on a redirect to another host
            verify=self.config.verify,
        )
        self._downloads = asyncio.Semaphore(max(1, self.config.max_downloads))

    async def close(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> RegistryClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- endpoints ------------------------------------------------------------------------------

    def _scheme(self, host: str) -> str:
        plain = host in self.config.insecure or _is_loopback_host(host)
        return "http" if plain else "https"

    def endpoints(self, ref: Reference) -> list[Endpoint]:
        out = []
        for m in self.config.mirrors.get(ref.registry, ()):
            if "://" in m:
                host = m.split("://", 1)[1].rstrip("/")
                out.append(Endpoint(m.rstrip("/"), host, True))
            else:
                out.append(Endpoint(f"{self._scheme(m)}://{m}", m, True))
        host = ref.api_host
        out.append(Endpoint(f"{self._scheme(host)}://{host}", host, False))
        return out

    # -- one request, authenticated -------------------------------------------------------------

    async def _send(
        self,
        ep: Endpoint,
        ref: Reference,
        path: str,
        headers: dict[str, str],
        what: str,
        *,
        stream: bool = False,
    ) -> httpx.Response:
        scope = f"repository:{ref.repository}:pull"
        url = f"{ep.base}/v2/{ref.repository}/{path}"
        for attempt in range(2):
            hdrs = dict(headers)
            auth = self.auth.header(ep.host, scope)
            if auth:
                hdrs["Authorization"] = auth
            req = self._http.build_request("GET", url, headers=hdrs)
            resp = await self._http.send(req, stream=stream)
            if resp.status_code != 401:
                return resp
            await resp.aclose()
            if attempt == 1:
                self.auth.forget(ep.host, scope)
                who = self.auth.credentials_for(ep.host)
                as_whom = f"as {who.username!r}" if who else "anonymously"
                raise Unauthorized(f"{what}: {ep.host} refused access {as_whom}")
            await self.auth.answer(self._http, ep.host, scope, resp, what)
        raise AssertionError("unreachable")

    # -- manifests ------------------------------------------------------------------------------

    async def _manifest(self, ref: Reference, selector: str) -> tuple[bytes, str | None, str]:
        """Body, Content-Type and digest of the manifest `selector` (tag or digest)."""
        what = f"manifest {ref.registry}/{ref.repository}:{selector}".replace(":sha256", "@sha256")
        last: Exception | None = None
        for ep in self.endpoints(ref):
            try:
                async with asyncio.timeout(self.config.timeout_s * 2):
                    self.stats.manifest_requests += 1
                    resp = await self._send(
                        ep, ref, f"manifests/{selector}", {"Accept": mf.ACCEPT}, what
                    )
                    body = resp.content
            except (httpx.HTTPError, TimeoutError) as exc:
                last = RegistryError(f"{what}: {ep.base} failed: {exc!r}")
                continue
            except Unauthorized as exc:
                last = exc
                continue
            if resp.status_code == 404:
                # docker-registry says MANIFEST_UNKNOWN for an unknown repository too.
                last = ManifestUnknown(
                    f"{what}: manifest unknown (the registry has no such repository or tag)"
                )
                continue
            if resp.status_code != 200:
                last = RegistryError(f"{what}: {ep.base} answered {resp.status_code}")
                continue
            if len(body) > MAX_MANIFEST_BYTES:
                last = RegistryError(f"{what}: manifest larger than {MAX_MANIFEST_BYTES} bytes")
                continue
            digest = "sha256:" + hashlib.sha256(body).hexdigest()
            header = resp.headers.get("docker-content-digest")
            if selector.startswith("sha256:") and digest != selector:
                raise DigestMismatch(f"{what}: the manifest received hashes to {digest}")
            if header and header.startswith("sha256:") and header != digest:
                raise DigestMismatch(
                    f"{what}: the registry says {header} but the manifest hashes to {digest}"
                )
            return body, resp.headers.get("content-type"), digest
        assert last is not None
        raise last

    async def resolve(self, ref: Reference, platform: mf.Platform = mf.LINUX_AMD64) -> Resolved:
        body, ctype, digest = await self._manifest(ref, ref.selector)
        parsed = mf.parse(body, ctype, f"{ref}")
        if isinstance(parsed, mf.ImageManifest):
            return Resolved(ref.with_digest(digest), digest, parsed, body)
        chosen = parsed.select(platform)
        body2, ctype2, digest2 = await self._manifest(ref, chosen.digest)
        inner = mf.parse(body2, ctype2 or chosen.media_type, f"{ref}@{chosen.digest}")
        if not isinstance(inner, mf.ImageManifest):
            raise RegistryError(f"{ref}: the {platform} entry of the index is another index")
        return Resolved(ref.with_digest(digest2), digest2, inner, body2, digest, body)

    # -- blobs ----------------------------------------------------------------------------------

    async def fetch_blob(
        self, ref: Reference, desc: mf.Descriptor, progress: ProgressFn | None = None
    ) -> Path:
        """The path of blob `desc` in the cache, downloaded (or resumed) if missing."""
        cache = self.cache
        if cache is None:
            raise OciError("fetch_blob needs a RegistryClient with an ImageCache")
        cache.ensure_dirs()
        final = cache.blob_path(desc.digest)
        async with file_lock(
            cache.lock_path(desc.digest),
            name=f"the download lock of {desc.digest}",
            timeout_s=DOWNLOAD_LOCK_TIMEOUT_S,
            waiter=f"a pull of {ref}",
        ):
            if final.is_file():
                size = final.stat().st_size
                if size == desc.size:
                    self.stats.blob_hits += 1
                    await asyncio.to_thread(cache.touch, [f"blob:{desc.digest}"])
                    return final
                # A cached blob never changes size; one that did is not to be trusted.
                await asyncio.to_thread(final.unlink)
            async with self._downloads:
                await self._download(ref, desc, progress)
            await asyncio.to_thread(cache.record, f"blob:{desc.digest}", "blob", desc.size)
            return final

    async def _download(
        self, ref: Reference, desc: mf.Descriptor, progress: ProgressFn | None
    ) -> None:
        assert self.cache is not None
        partial = self.cache.partial_path(desc.digest)
        try:
            await self._download_attempts(ref, desc, progress)
        except asyncio.CancelledError:
            # The pull gave up (another layer failed, or the build was cancelled) at any await
            # of the attempts (a stream, a retry's pause, the hash of a complete file): a
            # partial file nobody is coming back for would only hold disk space. Shielded: a
            # second cancel while it runs leaves the thread to finish the removal.
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.shield(asyncio.to_thread(partial.unlink, True))
            raise

    async def _download_attempts(
        self, ref: Reference, desc: mf.Descriptor, progress: ProgressFn | None
    ) -> None:
        assert self.cache is not None
        partial = self.cache.partial_path(desc.digest)
        final = self.cache.blob_path(desc.digest)
        what = f"blob {desc.digest} of {ref.registry}/{ref.repository}"
        restarted = False
        attempt = 0
        while True:
            attempt += 1
            resumed = partial.exists() and partial.stat().st_size > 0
            try:
                await self._stream_to(ref, desc, partial, what, progress)
            except SizeMismatch:
                await asyncio.to_thread(partial.unlink, True)
                raise
            except (httpx.TransportError, TimeoutError, _Retry) as exc:
                # A cut connection: what arrived stays in .partial for the next attempt.
                if attempt >= self.config.attempts:
                    raise RegistryError(
                        f"{what}: download failed after {attempt} attempts: {exc!r}"
                    ) from None
                await asyncio.sleep(0.2 * attempt)
                continue
            except OSError as exc:
                # Our side failed (a full disk, most likely): nothing of it is worth resuming,
                # and a kept partial file would hold on to the space.
                await asyncio.to_thread(partial.unlink, True)
                raise OciError(f"{what}: writing {partial} failed: {exc}") from exc
            got = partial.stat().st_size
            if got != desc.size:
                await asyncio.to_thread(partial.unlink, True)
                raise SizeMismatch(f"{what}: received {got} bytes, the manifest says {desc.size}")
            actual = await asyncio.to_thread(_sha256_file, partial)
            if actual != desc.digest:
                await asyncio.to_thread(partial.unlink, True)
                if resumed and not restarted:
                    # The part kept from an earlier attempt may be what is wrong: once more
                    # from the first byte before blaming the registry.
                    restarted = True
                    attempt = 0
                    continue
                raise DigestMismatch(f"{what}: the data received hashes to {actual}")
            partial.chmod(0o444)
            os.replace(partial, final)
            return

    async def _stream_to(
        self,
        ref: Reference,
        desc: mf.Descriptor,
        partial: Path,
        what: str,
        progress: ProgressFn | None,
    ) -> None:
        offset = await asyncio.to_thread(_resume_offset, partial, desc.size)
        if offset == desc.size and offset > 0:
            return
        last: Exception | None = None
        for ep in self.endpoints(ref):
            headers = {"Range": f"bytes={offset}-"} if offset else {}
            self.stats.blob_requests += 1
            if offset:
                self.stats.range_requests += 1
            try:
                resp = await self._send(ep, ref, f"blobs/{desc.digest}", headers, what, stream=True)
            except httpx.HTTPError as exc:
                last = RegistryError(f"{what}: {ep.base} failed: {exc!r}")
                if ep.mirror:
                    continue
                raise
            except Unauthorized as exc:
                last = exc
                if ep.mirror:
                    continue
                raise
            try:
                if resp.status_code == 404:
                    last = BlobUnknown(f"{what}: blob unknown to the registry")
                    continue
                if resp.status_code == 416 and offset:
                    # The server cannot serve a range of our partial file: start over.
                    await asyncio.to_thread(partial.unlink, True)
                    raise _Retry(f"{what}: range {offset}- not satisfiable")
                if resp.status_code not in (200, 206):
                    last = RegistryError(f"{what}: {ep.base} answered {resp.status_code}")
                    continue
                if resp.status_code == 200:
                    offset = 0  # the server ignored the Range header: start over
                await self._write_body(resp, partial, offset, desc, what, progress)
                return
            finally:
                await resp.aclose()
        assert last is not None
        raise last

    async def _write_body(
        self,
        resp: httpx.Response,
        partial: Path,
        offset: int,
        desc: mf.Descriptor,
        what: str,
        progress: ProgressFn | None,
    ) -> None:
        done = offset
        with partial.open("r+b" if offset else "wb") as fh:
            fh.seek(offset)
            fh.truncate()
            buf = bytearray()
            async for chunk in resp.aiter_bytes(CHUNK):
                done += len(chunk)
                self.stats.bytes_downloaded += len(chunk)
                if done > desc.size:
                    raise SizeMismatch(f"{what}: more than the {desc.size} bytes the manifest says")
                buf += chunk
                if len(buf) >= CHUNK:
                    await asyncio.to_thread(fh.write, bytes(buf))
                    buf.clear()
                    if progress:
                        progress(desc.digest, done, desc.size)
            if buf:
                await asyncio.to_thread(fh.write, bytes(buf))
            await asyncio.to_thread(fh.flush)
        if progress:
            progress(desc.digest, done, desc.size)
        self.stats.blobs_fetched += 1
