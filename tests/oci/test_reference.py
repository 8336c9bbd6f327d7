"""Reference parsing (Docker's rules), challenge parsing and the image config."""

from __future__ import annotations

import json

import pytest

from agentenv.oci.auth import parse_challenges
from agentenv.oci.blocks import chain_ids
from agentenv.oci.config import parse_config
from agentenv.oci.errors import InvalidReference
from agentenv.oci.reference import parse

D = "sha256:" + "a" * 64


@pytest.mark.parametrize(
    ("text", "registry", "repo", "tag", "digest"),
    [
        ("ubuntu", "docker.io", "library/ubuntu", "latest", None),
        ("ubuntu:22.04", "docker.io", "library/ubuntu", "22.04", None),
        ("user/app", "docker.io", "user/app", "latest", None),
        ("index.docker.io/user/app:1", "docker.io", "user/app", "1", None),
        ("localhost/app", "localhost", "app", "latest", None),
        ("127.0.0.1:5000/a/b:v1", "127.0.0.1:5000", "a/b", "v1", None),
        (f"quay.io/org/img@{D}", "quay.io", "org/img", None, D),
        (f"ghcr.io/o/i:t@{D}", "ghcr.io", "o/i", "t", D),
        ("[::1]:5000/app:x", "[::1]:5000", "app", "x", None),
    ],
)
def test_parse(text: str, registry: str, repo: str, tag: str | None, digest: str | None) -> None:
    ref = parse(text)
    assert (ref.registry, ref.repository, ref.tag, ref.digest) == (registry, repo, tag, digest)


def test_api_host_and_loopback() -> None:
    assert parse("ubuntu").api_host == "registry-1.docker.io"
    assert parse("127.0.0.1:5000/a").is_loopback
    assert parse("[::1]:5000/a").is_loopback
    assert parse("localhost:1/a").is_loopback
    assert not parse("10.0.0.1:5000/a").is_loopback
    assert str(parse("ubuntu")) == "docker.io/library/ubuntu:latest"


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("", "empty"),
        ("Ubuntu", "must be lowercase"),
        ("app:bad tag", "invalid tag"),
        ("app@sha256:123", "not a digest"),
        ("a//b", "not allowed"),
    ],
)
def test_invalid(text: str, why: str) -> None:
    with pytest.raises(InvalidReference, match=why):
        parse(text)


def test_challenges() -> None:
    got = parse_challenges(
        'Bearer realm="https://auth.example/token",service="reg",scope="repository:a/b:pull"'
    )
    assert got[0].scheme == "bearer"
    assert got[0].params == {
        "realm": "https://auth.example/token",
        "service": "reg",
        "scope": "repository:a/b:pull",
    }
    two = parse_challenges('Basic realm="x", Bearer realm="y"')
    assert [c.scheme for c in two] == ["basic", "bearer"]
    assert parse_challenges('Basic realm="a \\"q\\""')[0].params["realm"] == 'a "q"'


def test_chain_ids_follow_oci() -> None:
    a, b = "sha256:" + "1" * 64, "sha256:" + "2" * 64
    import hashlib

    assert chain_ids([a, b]) == [a, "sha256:" + hashlib.sha256(f"{a} {b}".encode()).hexdigest()]


def test_config_defaults_and_types() -> None:
    cfg = parse_config(json.dumps({"os": "linux", "architecture": "amd64"}).encode())
    assert (cfg.working_dir, cfg.user_name, cfg.command, cfg.env) == ("/", "root", (), ())
    full = parse_config(
        json.dumps(
            {
                "os": "linux",
                "architecture": "amd64",
                "config": {"User": "app:app", "Cmd": ["sh"], "ExposedPorts": {"80": {}}},
                "rootfs": {"diff_ids": [D]},
            }
        ).encode()
    )
    assert (full.user_name, full.cmd, full.exposed_ports, full.diff_ids) == (
        "app",
        ("sh",),
        ((80, "tcp"),),
        (D,),
    )
