"""`GET /files` (download) and `POST /files` (multipart or raw upload), streamed both ways.

Uploads go straight from the request body to the destination file in bounded chunks, so a
1 GiB file needs no more memory than a small one; a failed upload removes the file it created.
As upstream envd, both run as root whoever the request names: that user only owns what an upload
creates (the file and its missing parents) and anchors `~` and relative paths.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import stat
import zlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from python_multipart.multipart import MultipartParser, parse_options_header
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response, StreamingResponse

from . import disposition, paths
from .entries import printable, read_metadata, replace_metadata, validate_metadata
from .errors import EnvdFault, InvalidArgument, NotFound, ResourceExhausted
from .users import User

log = logging.getLogger("agentenv.envd")

FLUSH_BYTES = 1024 * 1024
METADATA_HEADER = "x-metadata-"
DOWNLOAD_CHUNK = 64 * 1024
# Files without a usable size (procfs/sysfs say 0, devices, FIFOs) are read this far ahead:
# to their end, they go out with an exact Content-Length; longer ones are sent chunked.
DOWNLOAD_PREFETCH = 1024 * 1024


def error_response(exc: EnvdFault) -> JSONResponse:
    message = printable(exc.message)
    return JSONResponse({"code": exc.status, "message": message}, status_code=exc.status)


def _stat_for_download(path: str) -> os.stat_result:
    try:
        st = os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        raise NotFound(f"path not found: {path}") from None
    if stat.S_ISDIR(st.st_mode):
        raise InvalidArgument(f"path is a directory: {path}")
    return st


async def download(request: Request, user: User, workdir: str | None = None) -> Response:
    raw = request.query_params.get("path")
    if not raw:
        raise InvalidArgument("query parameter 'path' is required")
    path = paths.resolve(raw, user, workdir)
    st = await asyncio.to_thread(_stat_for_download, path)
    # The name a browser saves it under, as upstream sends it (RFC 5987 when not ASCII).
    headers = {"content-disposition": disposition.inline(os.path.basename(path))}
    if request.headers.get("range") and stat.S_ISREG(st.st_mode) and st.st_size > 0:
        return FileResponse(
            path, media_type="application/octet-stream", stat_result=st, headers=headers
        )
    fd = await asyncio.to_thread(_open_for_reading, path)
    try:
        st = os.fstat(fd)
        if stat.S_ISREG(st.st_mode) and st.st_size > 0:
            return OpenFileResponse(fd, length=st.st_size, headers=headers)
        # procfs/sysfs files say 0 bytes and have content; devices and pipes have no size.
        head = await asyncio.to_thread(_read_up_to, fd, DOWNLOAD_PREFETCH)
        if len(head) < DOWNLOAD_PREFETCH:
            os.close(fd)
            return Response(head, media_type="application/octet-stream", headers=headers)
        return OpenFileResponse(fd, length=None, head=head, headers=headers)
    except BaseException:
        with contextlib.suppress(OSError):
            os.close(fd)
        raise


def _open_for_reading(path: str) -> int:
    # O_NONBLOCK: a FIFO without a writer must not hang the open; reads block again below.
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    os.set_blocking(fd, True)
    return fd


def _read_up_to(fd: int, limit: int) -> bytes:
    """Up to `limit` bytes, fewer only at end of file."""
    out = bytearray()
    while len(out) < limit:
        chunk = os.read(fd, min(DOWNLOAD_CHUNK, limit - len(out)))
        if not chunk:
            break
        out += chunk
    return bytes(out)


class OpenFileResponse(StreamingResponse):
    """An open file as the body, closed when the response is over however it ends.

    With `length`, exactly that many bytes under that Content-Length, whatever the file does
    meanwhile: Starlette's FileResponse reads to EOF and sends more than it declared when the
    file grows, and h11 then aborts the connection mid-body. Without, the rest of the file after
    `head`, chunked.
    """

    def __init__(
        self,
        fd: int,
        *,
        length: int | None,
        head: bytes = b"",
        headers: dict[str, str] | None = None,
    ) -> None:
        self.fd = fd
        self.length = length
        self.head = head
        headers = dict(headers or {})
        if length is not None:
            headers["content-length"] = str(length)
        super().__init__(self._chunks(), headers=headers, media_type="application/octet-stream")

    async def _chunks(self) -> AsyncIterator[bytes]:
        if self.head:
            yield self.head
        remaining = None if self.length is None else self.length - len(self.head)
        while remaining is None or remaining > 0:
            want = DOWNLOAD_CHUNK if remaining is None else min(DOWNLOAD_CHUNK, remaining)
            chunk = await asyncio.to_thread(os.read, self.fd, want)
            if not chunk:
                if remaining:
                    log.warning("file shrank while it was being sent (%d bytes short)", remaining)
                return
            if remaining is not None:
                remaining -= len(chunk)
            yield chunk

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with contextlib.suppress(OSError):
                os.close(self.fd)


class FileSink:
    """One destination file, written from the event loop through a thread in 1 MiB batches."""

    def __init__(self, path: str, user: User, metadata: dict[str, str]) -> None:
        self.path = path
        self.user = user
        self.metadata = metadata
        self.fd: int | None = None
        self.created = False
        self._buf = bytearray()

    async def open(self) -> None:
        await asyncio.to_thread(self._open)

    def _open(self) -> None:
        if os.path.isdir(self.path):
            raise InvalidArgument(f"path is a directory: {self.path}")
        paths.makedirs_as(os.path.dirname(self.path), self.user)
        self.created = not os.path.lexists(self.path)
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC
        try:
            self.fd = os.open(self.path, flags, 0o644)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise ResourceExhausted("not enough space (or inodes) for a new file") from None
            raise
        # The user owns the file afterwards, also one that existed and was someone else's
        # (upstream chowns an overwritten file to the uploader too).
        if os.geteuid() == 0:
            os.fchown(self.fd, self.user.uid, self.user.gid)

    async def write(self, data: bytes | memoryview) -> None:
        self._buf += data
        if len(self._buf) >= FLUSH_BYTES:
            await self.flush()

    async def flush(self) -> None:
        if not self._buf or self.fd is None:
            return
        chunk = bytes(self._buf)
        self._buf.clear()
        await asyncio.to_thread(_write_all, self.fd, chunk)

    async def close(self) -> None:
        await self.flush()
        if self.fd is not None:
            await asyncio.to_thread(self._set_metadata, self.fd)
            os.close(self.fd)
            self.fd = None

    def _set_metadata(self, fd: int) -> None:
        # Always, even with none given: an overwrite replaces the file's metadata whole.
        try:
            replace_metadata(fd, self.metadata)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise ResourceExhausted("not enough space for file metadata") from None
            if exc.errno != errno.EOPNOTSUPP:
                raise
            # procfs, sysfs, tmpfs on older kernels: the content is written, the metadata not.
            if self.metadata:
                log.warning("%s: the filesystem keeps no xattrs; metadata not stored", self.path)

    def abort(self) -> None:
        self._buf.clear()
        if self.fd is not None:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = None
        if self.created:
            with contextlib.suppress(OSError):
                os.unlink(self.path)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        try:
            written = os.write(fd, view)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise ResourceExhausted("not enough disk space") from None
            raise
        view = view[written:]


def _metadata(request: Request) -> dict[str, str]:
    return {
        key[len(METADATA_HEADER) :]: value
        for key, value in request.headers.items()
        if key.lower().startswith(METADATA_HEADER)
    }


def _written(path: str) -> dict[str, Any]:
    info: dict[str, Any] = {
        "name": printable(os.path.basename(path)),
        "type": "file",
        "path": printable(path),
    }
    # What the file now carries, read back as upstream does: not claimed if it was not stored.
    stored = read_metadata(path)
    if stored:
        info["metadata"] = stored
    return info


async def _body(request: Request) -> AsyncIterator[bytes]:
    """The request body, gunzipped when it was sent with Content-Encoding: gzip."""
    encoding = request.headers.get("content-encoding", "identity").lower()
    if encoding in ("", "identity"):
        async for chunk in request.stream():
            yield chunk
        return
    if encoding != "gzip":
        raise InvalidArgument(f"unsupported content-encoding {encoding!r}")
    inflater = zlib.decompressobj(wbits=31)
    async for chunk in request.stream():
        data = chunk
        while data:
            try:
                out = inflater.decompress(data, FLUSH_BYTES)
            except zlib.error as exc:
                raise InvalidArgument(f"invalid gzip body: {exc}") from None
            if out:
                yield out
            data = inflater.unconsumed_tail
    tail = inflater.flush()
    if tail:
        yield tail


async def upload(request: Request, user: User, workdir: str | None = None) -> Response:
    content_type = request.headers.get("content-type", "")
    mime, options = parse_options_header(content_type)
    raw_path = request.query_params.get("path")
    metadata = _metadata(request)
    validate_metadata(metadata)
    if mime == b"multipart/form-data":
        boundary = options.get(b"boundary")
        if not boundary:
            raise InvalidArgument("multipart upload without a boundary")
        destinations = _Destinations(user, workdir, raw_path)
        written = await _upload_multipart(request, user, boundary, destinations, metadata)
    else:
        if not raw_path:
            raise InvalidArgument("query parameter 'path' is required for a raw upload")
        sink = FileSink(paths.resolve(raw_path, user, workdir), user, metadata)
        await sink.open()
        try:
            async for chunk in _body(request):
                await sink.write(chunk)
            await sink.close()
        except BaseException:
            sink.abort()
            raise
        written = [_written(sink.path)]
    if not written:
        raise InvalidArgument("the upload contained no file")
    return JSONResponse(written)


class _Destinations:
    """Where each file of a multipart upload goes, as upstream decides it.

    The `path` query parameter, when given, is the destination of every `file` part; otherwise
    each part's filename is its path. Two parts for one destination are refused (after the
    first is written, as upstream): silently keeping only the last would lose data.
    """

    def __init__(self, user: User, workdir: str | None, raw_path: str | None) -> None:
        self.user = user
        self.workdir = workdir
        self.raw_path = raw_path
        self.used: list[str] = []

    def next(self, filename: str | None) -> str:
        target = self.raw_path if self.raw_path is not None else filename
        if target is None:
            raise InvalidArgument("multipart part has no filename and no 'path' was given")
        path = paths.resolve(target, self.user, self.workdir)
        if path in self.used:
            raise InvalidArgument(
                f"more than one file of this upload goes to {path}; only the first was written"
            )
        self.used.append(path)
        return path


@dataclass
class _PartState:
    headers: dict[str, bytes] = field(default_factory=dict)
    header_field: bytearray = field(default_factory=bytearray)
    header_value: bytearray = field(default_factory=bytearray)
    ops: list[tuple[str, Any]] = field(default_factory=list)


async def _upload_multipart(
    request: Request,
    user: User,
    boundary: bytes,
    destinations: _Destinations,
    metadata: dict[str, str],
) -> list[dict[str, Any]]:
    part = _PartState()

    def on_header_field(data: bytes, start: int, end: int) -> None:
        part.header_field += data[start:end]

    def on_header_value(data: bytes, start: int, end: int) -> None:
        part.header_value += data[start:end]

    def on_header_end() -> None:
        # Values stay bytes: a filename may be raw UTF-8 (httpx, browsers) or anything else.
        part.headers[part.header_field.decode("latin-1").lower()] = bytes(part.header_value)
        part.header_field.clear()
        part.header_value.clear()

    def on_headers_finished() -> None:
        params = disposition.params(part.headers.get("content-disposition", b""))
        part.ops.append(("open", (params.get("name"), params.get("filename"))))
        part.headers = {}

    def on_part_data(data: bytes, start: int, end: int) -> None:
        part.ops.append(("data", bytes(data[start:end])))

    def on_part_end() -> None:
        part.ops.append(("close", None))

    parser = MultipartParser(
        boundary,
        {
            "on_header_field": on_header_field,
            "on_header_value": on_header_value,
            "on_header_end": on_header_end,
            "on_headers_finished": on_headers_finished,
            "on_part_data": on_part_data,
            "on_part_end": on_part_end,
        },
    )
    written: list[dict[str, Any]] = []
    sink: FileSink | None = None
    try:
        async for chunk in _body(request):
            try:
                parser.write(chunk)
            except Exception as exc:
                raise InvalidArgument(f"malformed multipart body: {exc}") from None
            ops, part.ops = part.ops, []
            for op, arg in ops:
                if op == "open":
                    field_name, filename = arg
                    # Only `file` fields are files, as upstream: other form fields are skipped.
                    if field_name != "file":
                        continue
                    sink = FileSink(destinations.next(filename), user, metadata)
                    await sink.open()
                elif op == "data" and sink is not None:
                    await sink.write(arg)
                elif op == "close" and sink is not None:
                    await sink.close()
                    written.append(_written(sink.path))
                    sink = None
        parser.finalize()
    except BaseException:
        if sink is not None:
            sink.abort()
        raise
    return written
