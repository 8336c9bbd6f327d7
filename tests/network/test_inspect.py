"""Reading the name a client asks for from its first bytes (`network.inspect`): a ClientHello
made by Python's own TLS stack, and HTTP request heads."""

from __future__ import annotations

import ssl

import pytest

from agentenv.network.inspect import _NeedMore, http_host, name_in, tls_server_name


def client_hello(server_name: str | None) -> bytes:
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = ctx.wrap_bio(incoming, outgoing, server_hostname=server_name)
    with pytest.raises(ssl.SSLWantReadError):
        tls.do_handshake()
    return outgoing.read()


def test_sni_of_a_real_client_hello() -> None:
    hello = client_hello("Inet.Test")
    assert name_in(hello) == "inet.test"
    assert tls_server_name(client_hello(None)) is None


def test_a_hello_split_over_records_and_reads_is_reassembled() -> None:
    hello = client_hello("split.example")
    body = hello[5:]
    half = len(body) // 2
    records = b"".join(
        bytes([0x16, 3, 1]) + len(part).to_bytes(2, "big") + part
        for part in (body[:half], body[half:])
    )
    assert tls_server_name(records) == "split.example"
    for cut in (1, 4, 5, 40, len(records) - 1):
        with pytest.raises(_NeedMore):
            tls_server_name(records[:cut])


def test_http_host_header() -> None:
    head = b"GET /x HTTP/1.1\r\nUser-Agent: t\r\nHost: Inet.Test:8080\r\n\r\n"
    assert name_in(head) == "inet.test"
    with pytest.raises(_NeedMore):
        http_host(head[:20])
    assert http_host(b"GET / HTTP/1.1\r\nHost: [::1]:80\r\n\r\n") is None
    assert http_host(b"GET / HTTP/1.0\r\n\r\n") is None


def test_other_protocols_have_no_name() -> None:
    assert name_in(b"SSH-2.0-OpenSSH_9.2\r\n") is None
    assert tls_server_name(b"\x15\x03\x01\x00\x02\x02\x28") is None  # a TLS alert
    with pytest.raises(_NeedMore):
        name_in(b"")


def test_a_partial_request_line_waits_and_garbage_does_not() -> None:
    for partial in (b"G", b"GET", b"GET /", b"GET /a HTT", b"GET /a HTTP/1."):
        with pytest.raises(_NeedMore):
            http_host(partial)
    assert http_host(b"\x00\x01binary") is None
    assert http_host(b"hello there") is None
