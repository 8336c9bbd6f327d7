"""The build request as the SDK serializes it: accepted as sent, anything else named."""

from __future__ import annotations

import pytest
from e2b import Template, wait_for_port

from agentenv.build.spec import SpecError, chain_key, parse


def sdk_body(template: object) -> dict[str, object]:
    tpl = template._template  # type: ignore[attr-defined]
    body: dict[str, object] = tpl._serialize(tpl._instructions_with_hashes())
    return body


def test_sdk_template_parses() -> None:
    t = (
        Template()
        .from_template("base")
        .run_cmd("echo hi > /home/user/x")
        .set_envs({"A": "1"})
        .set_user("root")
        .set_workdir("/app")
        .pip_install("requests")
        .make_dir("/data")
        .set_start_cmd("python3 -m http.server 8000", wait_for_port(8000))
    )
    spec = parse(sdk_body(t))
    assert spec.from_template == "base" and spec.from_image is None
    assert [s.type for s in spec.steps] == ["RUN", "ENV", "USER", "WORKDIR", "RUN", "RUN"]
    assert spec.steps[4].args == ["pip install requests", "root"]
    assert spec.start_cmd == "python3 -m http.server 8000"
    assert spec.ready_cmd is not None and "8000" in spec.ready_cmd


def test_registry_credentials() -> None:
    t = Template().from_image("127.0.0.1:5000/app:1", username="u", password="p")
    spec = parse(sdk_body(t.run_cmd("true")))
    assert spec.credentials is not None and spec.credentials.username == "u"
    aws = Template().from_aws_registry("x/y:1", "AKIA", "secret", "eu-west-1")
    with pytest.raises(SpecError, match="aws"):
        parse(sdk_body(aws.run_cmd("true")))


@pytest.mark.parametrize(
    ("body", "named"),
    [
        ({"fromTemplate": "base", "volumes": []}, "volumes"),
        ({"fromTemplate": "base", "steps": [{"type": "RUN", "args": ["x"], "cache": 1}]}, "cache"),
        ({"fromTemplate": "base", "steps": [{"type": "HEALTHCHECK", "args": ["x"]}]}, "HEALTH"),
        ({"fromTemplate": "base", "fromImage": "debian"}, "exactly one"),
        ({"fromTemplate": "base", "steps": [{"type": "COPY", "args": ["a", "/b"]}]}, "filesHash"),
        ({"fromTemplate": "base", "steps": [{"type": "ENV", "args": ["A"]}]}, "pairs"),
    ],
)
def test_refused_fields_are_named(body: dict[str, object], named: str) -> None:
    with pytest.raises(SpecError, match=named):
        parse(body)


def test_chain_key_depends_on_parent_and_step() -> None:
    a = chain_key("", {"base": "x"})
    assert chain_key(a, {"s": 1}) == chain_key(a, {"s": 1})
    assert chain_key(a, {"s": 1}) != chain_key(a, {"s": 2})
    assert chain_key(a, {"s": 1}) != chain_key(chain_key("", {"base": "y"}), {"s": 1})
