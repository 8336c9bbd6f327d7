"""Template catalog: persistence, errors, forward compatibility."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from agentenv.config import Settings
from agentenv.template.catalog import Template, TemplateCatalog, TemplateNotFound
from agentenv.template.errors import CatalogError

D1 = "a" * 64
D2 = "b" * 64


@pytest.fixture
def settings(settings: Settings, tmp_path: Path) -> Settings:
    # A private data dir: the session's catalog may hold templates other tests rely on.
    return replace(settings, home=tmp_path)


def test_put_get_list_delete(settings: Settings) -> None:
    cat = TemplateCatalog(settings)
    assert cat.list() == []
    cat.put(Template(name="base", layers=[D1], size_mb=1024))
    cat.put(Template(name="py", layers=[D1, D2], size_mb=2048))
    again = TemplateCatalog(settings)
    assert [t.name for t in again.list()] == ["base", "py"]
    assert again.get("py").layers == [D1, D2]
    assert again.delete("base").name == "base"
    assert [t.name for t in TemplateCatalog(settings).list()] == ["py"]


def test_not_found_lists_known_templates(settings: Settings) -> None:
    cat = TemplateCatalog(settings)
    cat.put(Template(name="base", layers=[D1], size_mb=1024))
    with pytest.raises(TemplateNotFound) as err:
        cat.get("nope")
    assert str(err.value) == "template 'nope' not found (known templates: base)"
    with pytest.raises(TemplateNotFound):
        cat.delete("nope")


@pytest.mark.parametrize(
    ("name", "layers", "size"),
    [("Bad Name", [D1], 1), ("ok", ["not-a-digest"], 1), ("ok", [D1], 0), ("", [D1], 1)],
)
def test_invalid_templates_are_rejected(name: str, layers: list[str], size: int) -> None:
    with pytest.raises(CatalogError):
        Template(name=name, layers=layers, size_mb=size)


def test_corrupt_catalog_is_a_clear_error(settings: Settings) -> None:
    settings.templates_file.parent.mkdir(parents=True, exist_ok=True)
    settings.templates_file.write_text("{not json")
    with pytest.raises(CatalogError, match="corrupt"):
        TemplateCatalog(settings).list()


def test_unknown_fields_from_newer_versions_are_ignored(settings: Settings) -> None:
    settings.templates_file.parent.mkdir(parents=True, exist_ok=True)
    entry = {"name": "base", "layers": [D1], "size_mb": 10, "created_at": 1.0, "future": 1}
    settings.templates_file.write_text(json.dumps({"version": 2, "templates": [entry]}))
    assert TemplateCatalog(settings).get("base").size_mb == 10


def test_image_defaults_round_trip_and_old_catalogs_read(settings: Settings) -> None:
    cat = TemplateCatalog(settings)
    tpl = Template(
        name="img", layers=[D1, D2], size_mb=1024, source="127.0.0.1:5000/app@sha256:" + D1,
        env={"PATH": "/bin", "EQ": "a=b"}, workdir="/app", user="user",
        entrypoint=["python3"], cmd=["-m", "http.server"], exposed_ports=["8080/tcp"],
    )  # fmt: skip
    cat.put(tpl)
    got = TemplateCatalog(settings).get("img")
    assert got == tpl and got.has_defaults
    # A catalog written before the defaults existed: no defaults, envd's own apply.
    settings.templates_file.write_text(
        json.dumps({"version": 1, "templates": [
            {"name": "base", "layers": [D1], "size_mb": 1024, "created_at": 1.0,
             "build_key": "k", "snapshot": None}]})
    )  # fmt: skip
    old = TemplateCatalog(settings).get("base")
    assert (old.env, old.workdir, old.user, old.cmd) == ({}, None, None, [])
    assert not old.has_defaults


@pytest.mark.parametrize(
    "bad",
    [{"env": {"A": 1}}, {"workdir": "relative"}, {"user": ""}, {"cmd": "sh -c x"},
     {"exposed_ports": [8080]}],
)  # fmt: skip
def test_image_defaults_are_checked(bad: dict[str, object]) -> None:
    with pytest.raises(CatalogError):
        Template(name="img", layers=[D1], size_mb=1024, **bad)  # type: ignore[arg-type]
