"""envd's plain HTTP endpoints, secure mode and Connect framing, driven with raw httpx."""

# The tests inspect the real filesystem with blocking calls on purpose, beside envd.
# ruff: noqa: ASYNC240

from __future__ import annotations

import asyncio
import base64
import gzip
import hashlib
import json
import os
import pwd
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from agentenv.guest.envd import ENVD_VERSION
from agentenv.guest.envd.app import parse_timestamp
from agentenv.guest.envd.client import EnvdClient, EnvdError, EnvdTimeout, EnvdUnreachable
from agentenv.guest.envd.errors import InvalidArgument

from .conftest import EnvdProc
from .helpers import STREAM_HEADERS, UNARY_HEADERS, FrameReader, envelope


async def test_health_is_204(http: httpx.AsyncClient) -> None:
    response = await http.get("/health")
    assert response.status_code == 204
    assert response.headers["x-envd-version"] == ENVD_VERSION


async def test_init_sets_env_and_envs_reports_it(fresh_envd: EnvdProc) -> None:
    async with httpx.AsyncClient(base_url=fresh_envd.url) as http:
        response = await http.post(
            "/init",
            json={
                "envVars": {"A": "1", "B": "two"},
                "timestamp": "2026-01-02T03:04:05.123456789Z",
                "defaultUser": "root",
                "defaultWorkdir": "/tmp",
                "hostname": "ignored-on-host",
                "entropy": base64.b64encode(b"x" * 32).decode(),
                "volumeMounts": [],
            },
        )
        assert response.status_code == 204
        assert (await http.get("/envs")).json() == {"A": "1", "B": "two"}
    async with EnvdClient(fresh_envd.url) as client:
        result = await client.run("echo $A $B; whoami; pwd")
    assert result.stdout.split() == ["1", "two", "root", "/tmp"]


@pytest.mark.parametrize(
    ("value", "ns"),
    [
        ("2026-01-02T03:04:05.123456789Z", 1767323045_123456789),
        ("2026-01-02T04:04:05+01:00", 1767323045_000000000),
        ("2026-01-02T03:04:05.5Z", 1767323045_500000000),
        (1767323045, 1767323045_000000000),
    ],
)
def test_init_timestamp_formats(value: object, ns: int) -> None:
    assert parse_timestamp(value) == ns


@pytest.mark.parametrize("value", ["yesterday", "2026-01-02", True, None])
def test_init_timestamp_rejects(value: object) -> None:
    with pytest.raises(InvalidArgument):
        parse_timestamp(value)


@pytest.mark.parametrize(
    "body",
    [
        b"{not json",
        b"[]",
        json.dumps({"envVars": {"A": 1}}).encode(),
        json.dumps({"defaultUser": "no-such-user"}).encode(),
    ],
)
async def test_init_rejects_bad_input(fresh_envd: EnvdProc, body: bytes) -> None:
    async with httpx.AsyncClient(base_url=fresh_envd.url) as http:
        response = await http.post(
            "/init", content=body, headers={"content-type": "application/json"}
        )
        assert response.status_code in (400, 401)
        assert set(response.json()) == {"code", "message"}
        assert (await http.get("/envs")).json() == {}


async def test_metrics(http: httpx.AsyncClient) -> None:
    metrics = (await http.get("/metrics")).json()
    assert metrics["cpu_count"] == os.cpu_count()
    assert 0 <= metrics["cpu_used_pct"] <= 100
    assert 0 < metrics["mem_used"] < metrics["mem_total"]
    assert 0 < metrics["disk_used"] < metrics["disk_total"]


async def test_multipart_upload_many_files_then_download(
    http: httpx.AsyncClient, user_home: Path, scratch: Path
) -> None:
    files = [
        ("file", (str(scratch / "a.txt"), b"hello", "text/plain")),
        (
            "file",
            (str(scratch / "deep" / "er" / "b.bin"), b"\x00\x01\x02", "application/octet-stream"),
        ),
    ]
    response = await http.post("/files", files=files)
    assert response.status_code == 200, response.text
    assert response.json() == [
        {"name": "a.txt", "type": "file", "path": str(scratch / "a.txt")},
        {"name": "b.bin", "type": "file", "path": str(scratch / "deep" / "er" / "b.bin")},
    ]
    uid = pwd.getpwnam("user").pw_uid
    assert (scratch / "deep" / "er" / "b.bin").stat().st_uid == uid
    assert (scratch / "deep").stat().st_uid == uid
    download = await http.get("/files", params={"path": str(scratch / "deep/er/b.bin")})
    assert download.status_code == 200
    assert download.content == b"\x00\x01\x02"
    assert download.headers["content-type"] == "application/octet-stream"


async def test_single_multipart_uses_path_and_user(http: httpx.AsyncClient, scratch: Path) -> None:
    target = scratch / "as-root.txt"
    response = await http.post(
        "/files",
        params={"path": str(target), "username": "root"},
        files=[("file", ("ignored-name", b"r", "text/plain"))],
    )
    assert response.status_code == 200
    assert response.json()[0]["path"] == str(target)
    assert target.stat().st_uid == 0
    # The user overwrites root's 0644 file, as on upstream (which writes as root), and the file
    # becomes the user's: upstream chowns an overwritten file to the uploader.
    response = await http.post(
        "/files", params={"path": str(target)}, files=[("file", ("x", b"u", "text/plain"))]
    )
    assert response.status_code == 200, response.text
    assert target.read_bytes() == b"u"
    assert target.stat().st_uid == pwd.getpwnam("user").pw_uid


async def test_octet_stream_gzip_and_metadata(http: httpx.AsyncClient, scratch: Path) -> None:
    target = scratch / "z.txt"
    response = await http.post(
        "/files",
        params={"path": str(target)},
        content=gzip.compress(b"zipped " * 1000),
        headers={
            "content-type": "application/octet-stream",
            "content-encoding": "gzip",
            "x-metadata-owner": "me",
        },
    )
    assert response.status_code == 200, response.text
    assert response.json() == [
        {"name": "z.txt", "type": "file", "path": str(target), "metadata": {"owner": "me"}}
    ]
    assert target.read_bytes() == b"zipped " * 1000
    stat = await http.post(
        "/filesystem.Filesystem/Stat", json={"path": str(target)}, headers=UNARY_HEADERS
    )
    assert stat.json()["entry"]["metadata"] == {"owner": "me"}


async def test_file_errors(http: httpx.AsyncClient, scratch: Path) -> None:
    missing = await http.get("/files", params={"path": str(scratch / "missing")})
    assert missing.status_code == 404 and missing.json()["code"] == 404
    directory = await http.get("/files", params={"path": str(scratch)})
    assert directory.status_code == 400
    no_path = await http.get("/files")
    assert no_path.status_code == 400
    (scratch / "f").write_text("")
    through_a_file = await http.get("/files", params={"path": str(scratch / "f" / "x")})
    assert through_a_file.status_code == 404
    bad_gzip = await http.post(
        "/files",
        params={"path": str(scratch / "g")},
        content=b"not gzip",
        headers={"content-type": "application/octet-stream", "content-encoding": "gzip"},
    )
    assert bad_gzip.status_code == 400
    assert not (scratch / "g").exists(), "a failed upload leaves nothing behind"


async def test_one_gib_upload_and_download_in_flat_memory(
    envd: EnvdProc, scratch: Path, tmp_path: Path
) -> None:
    size = 1024 * 1024 * 1024
    block = os.urandom(1024 * 1024)
    source = tmp_path / "big.bin"
    want = hashlib.sha256()
    with source.open("wb") as f:
        for i in range(size // len(block)):
            chunk = i.to_bytes(8, "big") + block[8:]
            want.update(chunk)
            f.write(chunk)
    rss_peak = envd.rss_mib()
    stop = asyncio.Event()

    async def sample() -> None:
        nonlocal rss_peak
        while not stop.is_set():
            rss_peak = max(rss_peak, envd.rss_mib())
            await asyncio.sleep(0.05)

    sampler = asyncio.create_task(sample())

    async def body() -> AsyncIterator[bytes]:
        with source.open("rb") as f:
            while chunk := f.read(256 * 1024):
                yield chunk

    target = scratch / "big.bin"
    try:
        async with httpx.AsyncClient(base_url=envd.url, timeout=300) as http:
            started = time.monotonic()
            response = await http.post(
                "/files",
                params={"path": str(target)},
                content=body(),
                headers={"content-type": "application/octet-stream"},
            )
            upload_s = time.monotonic() - started
            assert response.status_code == 200, response.text
            assert target.stat().st_size == size
            got = hashlib.sha256()
            started = time.monotonic()
            async with http.stream("GET", "/files", params={"path": str(target)}) as download:
                assert download.status_code == 200
                async for chunk in download.aiter_bytes():
                    got.update(chunk)
            download_s = time.monotonic() - started
    finally:
        stop.set()
        await sampler
    assert got.hexdigest() == want.hexdigest()
    assert rss_peak < 150, f"envd RSS reached {rss_peak:.0f} MiB"
    print(
        f"1 GiB upload {size / upload_s / 1e6:.0f} MB/s, "
        f"download {size / download_s / 1e6:.0f} MB/s, envd RSS peak {rss_peak:.0f} MiB"
    )


# Secure mode ------------------------------------------------------------------------------


def _sign(path: str, op: str, user: str, token: str, expiration: int | None) -> str:
    raw = f"{path}:{op}:{user}:{token}" + (f":{expiration}" if expiration is not None else "")
    return "v1_" + base64.b64encode(hashlib.sha256(raw.encode()).digest()).rstrip(b"=").decode()


async def test_secure_mode(fresh_envd: EnvdProc, tmp_path: Path) -> None:
    token = "s3cret-token"
    async with httpx.AsyncClient(base_url=fresh_envd.url) as http:
        assert (await http.post("/init", json={"accessToken": token})).status_code == 204
        # Everything but /health now needs the token.
        assert (await http.get("/health")).status_code == 204
        rpc = await http.post("/process.Process/List", json={}, headers=UNARY_HEADERS)
        assert rpc.status_code == 401
        assert rpc.json()["code"] == "unauthenticated"
        wrong = await http.post(
            "/process.Process/List", json={}, headers={**UNARY_HEADERS, "x-access-token": "nope"}
        )
        assert wrong.status_code == 401
        stream = await http.post(
            "/process.Process/Start",
            content=envelope({"process": {"cmd": "/bin/true"}}),
            headers=STREAM_HEADERS,
        )
        assert stream.status_code == 401
        for method, path in [
            ("GET", "/envs"),
            ("GET", "/metrics"),
            ("GET", "/files?path=/etc/hostname"),
        ]:
            assert (await http.request(method, path)).status_code == 401, path
        assert (await http.post("/init", json={"accessToken": "other"})).status_code == 401

        ok = await http.post(
            "/process.Process/List", json={}, headers={**UNARY_HEADERS, "x-access-token": token}
        )
        assert ok.status_code == 200

        # Signed URLs work without the header, for the signed operation only.
        target = str(tmp_path / "signed.txt")
        expiration = int(time.time()) + 60
        write_sig = _sign(target, "write", "root", token, expiration)
        up = await http.post(
            "/files",
            params={
                "path": target,
                "username": "root",
                "signature": write_sig,
                "signature_expiration": expiration,
            },
            content=b"signed",
            headers={"content-type": "application/octet-stream"},
        )
        assert up.status_code == 200, up.text
        read_sig = _sign(target, "read", "root", token, None)
        down = await http.get(
            "/files", params={"path": target, "username": "root", "signature": read_sig}
        )
        assert down.content == b"signed"
        wrong_op = await http.get(
            "/files",
            params={
                "path": target,
                "username": "root",
                "signature": write_sig,
                "signature_expiration": expiration,
            },
        )
        assert wrong_op.json() == {"code": 401, "message": "invalid signature"}
        # Upstream envd's messages and order (`validateSigning`): the signature first, then
        # its expiry; what E2B's suites compare whole.
        expired = _sign(target, "read", "root", token, 1000)
        old = await http.get(
            "/files",
            params={
                "path": target,
                "username": "root",
                "signature": expired,
                "signature_expiration": 1000,
            },
        )
        assert old.status_code == 401
        assert old.json() == {"code": 401, "message": "signature is already expired"}
        forged = await http.get(
            "/files",
            params={"path": target, "signature": expired, "signature_expiration": 1000},
        )
        assert forged.json() == {"code": 401, "message": "invalid signature"}
        unparsable = await http.get(
            "/files", params={"path": target, "signature": read_sig, "signature_expiration": "x"}
        )
        assert unparsable.status_code == 400
        bare = await http.get("/files", params={"path": target})
        assert bare.json() == {"code": 401, "message": "missing signature query parameter"}
        # A token in the header decides alone, even beside a good signature.
        mismatch = await http.get(
            "/files",
            params={"path": target, "username": "root", "signature": read_sig},
            headers={"x-access-token": "not-" + token},
        )
        assert mismatch.json() == {
            "code": 401,
            "message": "access token present in header but does not match",
        }

    async with EnvdClient(fresh_envd.url) as client:
        with pytest.raises(EnvdError) as err:
            await client.run("true")
        assert err.value.code == "unauthenticated"
        client.access_token = token
        assert (await client.run("echo ok", user="root")).stdout == "ok\n"


# Connect framing --------------------------------------------------------------------------


async def test_stream_framing_is_exact(http: httpx.AsyncClient) -> None:
    body = envelope({"process": {"cmd": "/bin/echo", "args": ["hi"]}, "stdin": False})
    async with http.stream(
        "POST", "/process.Process/Start", content=body, headers=STREAM_HEADERS
    ) as response:
        assert response.status_code == 200
        assert response.headers["content-type"] == "application/connect+json"
        reader = FrameReader()
        frames = []
        async for chunk in response.aiter_raw():
            frames += reader.feed(chunk)
    assert not reader.buf
    assert [flags for flags, _ in frames] == [0, 0, 0, 2]
    messages = [json.loads(payload) for _, payload in frames]
    assert set(messages[0]["event"]["start"]) == {"pid"}
    assert base64.b64decode(messages[1]["event"]["data"]["stdout"]) == b"hi\n"
    assert messages[2]["event"]["end"] == {"exited": True, "status": "exit status 0"}
    assert messages[3] == {}


async def test_chunked_request_body(http: httpx.AsyncClient) -> None:
    """The SDK sends streaming requests chunked; split the envelope across chunks."""
    body = envelope({"process": {"cmd": "/bin/echo", "args": ["chunked"]}})

    async def chunks() -> AsyncIterator[bytes]:
        for i in range(0, len(body), 7):
            yield body[i : i + 7]
            await asyncio.sleep(0.01)

    async with http.stream(
        "POST", "/process.Process/Start", content=chunks(), headers=STREAM_HEADERS
    ) as response:
        raw = await response.aread()
    frames = FrameReader().feed(raw)
    assert base64.b64decode(json.loads(frames[1][1])["event"]["data"]["stdout"]) == b"chunked\n"


async def test_unary_errors_are_connect_json(http: httpx.AsyncClient) -> None:
    missing = await http.post(
        "/filesystem.Filesystem/Stat", json={"path": "/no/such"}, headers=UNARY_HEADERS
    )
    assert missing.status_code == 404
    assert missing.headers["content-type"].startswith("application/json")
    assert missing.json()["code"] == "not_found"
    exists = await http.post(
        "/filesystem.Filesystem/MakeDir", json={"path": "/tmp"}, headers=UNARY_HEADERS
    )
    assert (exists.status_code, exists.json()["code"]) == (409, "already_exists")
    bad = await http.post("/filesystem.Filesystem/Stat", content=b"{oops", headers=UNARY_HEADERS)
    assert (bad.status_code, bad.json()["code"]) == (400, "invalid_argument")
    wrong_type = await http.post(
        "/process.Process/SendSignal", json={"process": {"pid": "x"}}, headers=UNARY_HEADERS
    )
    assert (wrong_type.status_code, wrong_type.json()["code"]) == (400, "invalid_argument")
    unknown = await http.post("/process.Process/Nope", json={}, headers=UNARY_HEADERS)
    assert (unknown.status_code, unknown.json()["code"]) == (404, "unimplemented")
    other = await http.post("/foo.Bar/Baz", json={}, headers=UNARY_HEADERS)
    assert other.json()["code"] == "unimplemented"
    # envd is still fine afterwards.
    assert (await http.get("/health")).status_code == 204


async def test_invalid_stream_request_ends_with_connect_error(http: httpx.AsyncClient) -> None:
    body = b"\x00\x00\x00\x00\x05{oops"
    async with http.stream(
        "POST", "/process.Process/Start", content=body, headers=STREAM_HEADERS
    ) as response:
        raw = await response.aread()
    flags, payload = FrameReader().feed(raw)[-1]
    assert flags == 2
    assert json.loads(payload)["error"]["code"] == "invalid_argument"


async def test_double_slash_from_trailing_slash_base_url(envd: EnvdProc) -> None:
    async with httpx.AsyncClient() as http:
        response = await http.post(
            envd.url + "//process.Process/List", json={}, headers=UNARY_HEADERS
        )
    assert response.status_code == 200
    assert response.json() == {} or "processes" in response.json()


async def test_client_helper(envd: EnvdProc) -> None:
    async with EnvdClient(envd.url + "/") as client:
        assert await client.health()
        await client.wait_healthy(5)
        result = await client.run("uname -s; echo err >&2; exit 4", user="root")
        assert result == (4, "Linux\n", "err\n")
    async with EnvdClient("http://127.0.0.1:1") as dead:
        assert not await dead.health()
        with pytest.raises(EnvdTimeout, match=r"not healthy after 0\.3s"):
            await dead.wait_healthy(0.3)
        # Callers catch the client's errors only: the transport's never leave it.
        with pytest.raises(
            EnvdUnreachable, match=r"process.Start: Unreachable: .*Connect call failed"
        ):
            await dead.run("true", user="root")
        with pytest.raises(EnvdUnreachable, match=r"/init: Unreachable: .*Connect call failed"):
            await dead.init()
        with pytest.raises(EnvdUnreachable, match="the VM exited"):
            await dead.wait_healthy(30, gone=lambda: "the VM exited")


async def test_zero_size_proc_files_come_whole_on_a_healthy_connection(envd: EnvdProc) -> None:
    """procfs/sysfs report size 0 but have content: exact Content-Length, connection reusable."""
    limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
    async with httpx.AsyncClient(base_url=envd.url, timeout=30, limits=limits) as one:
        for path in ("/proc/sys/kernel/random/boot_id", "/proc/self/status", "/proc/meminfo"):
            response = await one.get("/files", params={"path": path, "username": "root"})
            assert response.status_code == 200, response.text
            assert response.content, path
            assert int(response.headers["content-length"]) == len(response.content)
        boot_id = await one.get("/files", params={"path": "/proc/sys/kernel/random/boot_id"})
        assert boot_id.text == Path("/proc/sys/kernel/random/boot_id").read_text()
        empty = await one.get("/files", params={"path": "/dev/null"})
        assert (empty.status_code, empty.content) == (200, b"")
        assert empty.headers["content-length"] == "0"
        directory = await one.get("/files", params={"path": "/proc/self/task"})
        assert directory.status_code == 400
        assert (await one.get("/health")).status_code == 204


async def test_unsized_file_longer_than_the_read_ahead_is_chunked(
    http: httpx.AsyncClient, scratch: Path
) -> None:
    fifo = scratch / "fifo"
    os.mkfifo(fifo)
    os.chown(fifo, pwd.getpwnam("user").pw_uid, -1)
    payload = os.urandom(3 * 1024 * 1024 + 17)

    def feed() -> None:
        with fifo.open("wb") as writer:
            writer.write(payload)

    # The writer waits in open() for a reader, already counted as a writer, so envd's read
    # blocks for data rather than seeing EOF.
    writer = asyncio.create_task(asyncio.to_thread(feed))
    await asyncio.sleep(0.3)
    response = await http.get("/files", params={"path": str(fifo)})
    await writer
    if response.content == b"":
        # envd opened the FIFO before the writer: an empty pipe without writers is EOF.
        pytest.skip("the FIFO had no writer yet when envd read it")
    assert response.status_code == 200
    assert "content-length" not in response.headers
    assert response.headers.get("transfer-encoding") == "chunked"
    assert response.content == payload


async def test_uploads_create_missing_parents_for_the_user(
    http: httpx.AsyncClient, scratch: Path
) -> None:
    uid = pwd.getpwnam("user").pw_uid
    locked = scratch / "locked"
    locked.mkdir()
    os.chown(locked, 0, 0)
    # Multipart without `path` (each filename is the destination), and raw octet-stream.
    multipart = await http.post(
        "/files",
        files=[
            ("file", (str(locked / "m" / "n" / "1.txt"), b"one", "text/plain")),
            ("file", (str(locked / "m" / "2.txt"), b"two", "text/plain")),
        ],
    )
    assert multipart.status_code == 200, multipart.text
    raw = await http.post(
        "/files",
        params={"path": str(locked / "r" / "s" / "3.bin")},
        content=b"three",
        headers={"content-type": "application/octet-stream"},
    )
    assert raw.status_code == 200, raw.text
    for path in ("m", "m/n", "m/n/1.txt", "m/2.txt", "r", "r/s", "r/s/3.bin"):
        assert (locked / path).stat().st_uid == uid, path
    assert (locked / "m" / "n" / "1.txt").read_bytes() == b"one"
    # Straight into the root-owned directory too: upstream writes as root, then chowns.
    straight = await http.post(
        "/files",
        params={"path": str(locked / "4.txt")},
        content=b"yes",
        headers={"content-type": "application/octet-stream"},
    )
    assert straight.status_code == 200, straight.text
    assert (locked / "4.txt").stat().st_uid == uid
    assert locked.stat().st_uid == 0, "an existing directory keeps its owner"
    through_a_file = await http.post(
        "/files",
        params={"path": str(locked / "m" / "2.txt" / "5.txt")},
        content=b"no",
        headers={"content-type": "application/octet-stream"},
    )
    assert through_a_file.status_code == 400
    bad_metadata = await http.post(
        "/files",
        params={"path": str(scratch / "meta.txt")},
        content=b"x",
        headers={"content-type": "application/octet-stream", "x-metadata-k": b"caf\xc3\xa9"},
    )
    assert bad_metadata.status_code == 400
    assert "non-printable-ASCII" in bad_metadata.json()["message"]
